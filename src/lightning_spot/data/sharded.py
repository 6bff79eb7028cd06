"""Global batches that survive layout changes: each data-parallel replica loads its share.

    loader = shard_dataloader(loader, dp_rank=1, dp_size=2, divisor=8, seed=0)

The user's DataLoader ``batch_size`` is the *global* batch. Every replica iterates the same
sequence of global batches (the order depends only on the seed and the epoch, never on the
layout) and takes its contiguous ``1/D`` slice of each; all pipeline stages of a replica load the
same slice. ``shuffle=True`` is replaced by a sampler seeded with ``seed + epoch`` (the same rule
as ``DistributedSampler``), because a ``RandomSampler`` draws from each process's global RNG. A user's own
``DistributedSampler`` gives the whole dataset's order; other random draws of samplers, ``__getitem__`` and
``collate_fn`` are seeded alike on every stage of a pipeline (:mod:`lightning_spot.data.draws`).
A plain ``TensorDataset`` (or a ``Subset`` of one) with the default collate function is read one index per tensor
(:class:`TensorRows`), as a hand-written loop slices its tensors, instead of one ``__getitem__`` per sample.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence, Sized
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    RandomSampler,
    Sampler,
    Subset,
    TensorDataset,
    default_collate,
)

from lightning_spot.data.draws import SeededFetches, draws_from_process, replica_worker_init, whole_dataset_order
from lightning_spot.layout import LayoutError
from lightning_spot.replay.draws import draw_key, seeded_draws
from lightning_spot.utils.units import divisors


class EpochShuffleSampler(Sampler[int]):
    """A permutation of ``range(len(data_source))`` that depends only on ``seed + epoch``."""

    def __init__(self, data_source: Sized, seed: int = 0) -> None:
        self.num_samples = len(data_source)
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.num_samples, generator=g).tolist())

    def __len__(self) -> int:
        return self.num_samples


class _LightningEpochs:
    """The inner sampler as Lightning sees it, except that ``set_epoch`` goes through the replica sampler (which
    records the epoch in checkpoints; Lightning only calls ``set_epoch`` on ``batch_sampler.sampler``)."""

    def __init__(self, owner: ReplicaBatchSampler, inner: Any) -> None:
        self._owner = owner
        self._inner = inner

    def set_epoch(self, epoch: int) -> None:
        self._owner.from_lightning(epoch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __iter__(self) -> Iterator[int]:
        return iter(self._inner)

    def __len__(self) -> int:
        return len(self._inner)


def valid_global_batches(divisor: int, near: int, count: int = 4) -> list[int]:
    """Multiples of ``divisor`` close to ``near``, for error messages."""
    base = max(1, near // divisor)
    return sorted({divisor * k for k in range(max(1, base - 1), base + count)})[:count]


def explain_indivisible_batch(size: int, dp_size: int, microbatches: int | None, world_size: int | None) -> str:
    """Why a global batch does not fit the layout, and every way to make it fit."""
    m = microbatches or 1
    parts = [
        f"A global batch of {size} samples cannot be split evenly into {dp_size} data-parallel replicas"
        + (f" x {m} micro-batches." if microbatches else "."),
        f"Use a DataLoader batch_size that is a multiple of {dp_size * m} (e.g. {valid_global_batches(dp_size * m, size)}),"
        f" or drop_last=True if only the last batch is short.",
    ]
    if world_size:
        fitting = [(world_size // d, d) for d in divisors(world_size) if size % (d * m) == 0]
        if fitting:
            parts.append(
                "To keep this global batch (e.g. when resuming on another number of GPUs), use a layout whose "
                "data-parallel width divides it: " + ", ".join(f"pipeline_stages={p} (D={d})" for p, d in fitting) + "."
            )
    if microbatches and size % dp_size == 0:
        parts.append(f"Or keep this layout with microbatches in {divisors(size // dp_size)}.")
    return " ".join(parts)


def replica_slice(size: int, dp_rank: int, dp_size: int, weights: Sequence[int] | None = None) -> slice:
    """The contiguous part of a global batch of ``size`` samples that replica ``dp_rank`` owns.

    ``weights`` (pipelines of mixed depths: each pipeline's micro-batches) give each replica a share in
    proportion; else the shares are equal.
    """
    if weights is not None:
        total, before = sum(weights), sum(weights[:dp_rank])
        return slice(size * before // total, size * (before + weights[dp_rank]) // total)
    base, extra = divmod(size, dp_size)
    start = dp_rank * base + min(dp_rank, extra)
    return slice(start, start + base + (1 if dp_rank < extra else 0))


class ReplicaBatchSampler(Sampler[list[int]]):
    """Yields this replica's share of every global batch of ``batch_sampler``.

    With ``divisor`` set (training), every global batch must be a multiple of it
    (``data_parallel x microbatches``, the total micro-batches) so that all micro-batches are equal.
    ``weights``: shares in proportion (pipelines of mixed depths), see :func:`replica_slice`.
    """

    def __init__(
        self,
        batch_sampler: Any,
        dp_rank: int,
        dp_size: int,
        divisor: int | None,
        world_size: int | None = None,
        weights: Sequence[int] | None = None,
    ) -> None:
        self.batch_sampler = batch_sampler
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.weights = list(weights) if weights is not None else None
        self.divisor = divisor
        self.world_size = world_size
        self.epoch = 0  # the epoch whose order is drawn: what a checkpoint records
        self._skip: tuple[int, int] | None = None
        self._lightning_lag = 0  # this epoch minus Lightning's count of it (see ``from_lightning``)
        self._align: int | None = None  # the epoch Lightning's next ``set_epoch`` stands for, after a resume
        #: the seed of each epoch's order where the batch sampler draws from the process's generators: the order is
        #: then drawn whole at the epoch's start, from ``seed + epoch``, the same on every rank (``_data_draws``)
        self.draw_seed: int | None = None

    def resume(self, epoch: int, done: int) -> None:
        """Continue epoch ``epoch`` after its first ``done`` global batches (or the next epoch if it was over)."""
        if done >= len(self):
            self.set_epoch(epoch + 1)
            self._skip = None
        else:
            self.set_epoch(epoch)
            self._skip = (epoch, done) if done > 0 else None
        self._align = self.epoch

    @property
    def sampler(self) -> Any:
        """What Lightning sees as the loader's sampler: its ``set_epoch`` calls reach :meth:`from_lightning`."""
        inner = getattr(self.batch_sampler, "sampler", None)
        return None if inner is None else _LightningEpochs(self, inner)

    def from_lightning(self, epoch: int) -> None:
        """Lightning starts its epoch ``epoch``. Its count can be one behind after a resume from a checkpoint
        taken at the last batch of an epoch twice in a row (it then runs the finished epoch's number again): the
        first call after a resume is aligned with the epoch the checkpoint said comes next, and the later ones
        keep that difference, so that the order of the data never depends on where the run was interrupted."""
        if self._align is not None:
            self._lightning_lag, self._align = self._align - epoch, None
        self.set_epoch(epoch + self._lightning_lag)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        for target in (self.batch_sampler, getattr(self.batch_sampler, "sampler", None)):
            set_epoch = getattr(target, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        skip = self._skip[1] if self._skip is not None and self._skip[0] == self.epoch else 0
        self._skip = None
        for position, batch in enumerate(self._batches()):
            if position < skip:
                continue
            batch = list(batch)
            if self.divisor is not None and len(batch) % self.divisor:
                if self.weights is not None:
                    raise LayoutError(
                        f"A global batch of {len(batch)} samples cannot be cut into the {self.divisor} equal "
                        f"micro-batches that the pipelines of mixed depths run ({'+'.join(map(str, self.weights))}). "
                        f"Use a DataLoader batch_size that is a multiple of {self.divisor} "
                        f"(e.g. {valid_global_batches(self.divisor, len(batch))}), or drop_last=True."
                    )
                m = self.divisor // self.dp_size
                raise LayoutError(
                    explain_indivisible_batch(len(batch), self.dp_size, m if m > 1 else None, self.world_size)
                )
            share = replica_slice(len(batch), self.dp_rank, self.dp_size, self.weights)
            if len(batch) < self.dp_size or share.stop <= share.start:
                raise LayoutError(
                    f"A batch of {len(batch)} samples is too small for the {self.dp_size} data-parallel replicas; "
                    f"use a larger batch_size or drop_last=True."
                )
            yield batch[share]

    def _batches(self) -> Any:
        if self.draw_seed is None:
            return self.batch_sampler
        with seeded_draws(draw_key(self.draw_seed, self.epoch)):
            return [list(batch) for batch in self.batch_sampler]

    def __len__(self) -> int:
        return len(self.batch_sampler)


class ShardedDataLoader(DataLoader):
    """A replica's DataLoader that can resume mid-epoch, on any layout (Lightning's stateful-loader protocol).

    Its state is the epoch and the number of *global* batches already trained in it, which means the
    same thing for every P x D layout.
    """

    progress: Callable[[], int] | None = None
    #: what ``__getitem__`` and ``collate_fn`` draw at random comes from this seed, the epoch, the batch and the
    #: replica (the same on every stage of a pipeline); ``None``: the rows are read without drawing (TensorRows)
    draw_seed: int | None = None
    dp_rank: int = 0

    def _get_iterator(self) -> Any:
        if self.draw_seed is None:
            return super()._get_iterator()
        epoch = self.replica_sampler.epoch
        # (an iterator draws its workers' seeds when it is made; forked workers inherit Python's and NumPy's states)
        with seeded_draws(draw_key(self.draw_seed, epoch, self.dp_rank)):
            if self.num_workers == 0:
                return SeededFetches(self, self.draw_seed, epoch, self.dp_rank)
            return super()._get_iterator()

    @property
    def replica_sampler(self) -> ReplicaBatchSampler:
        sampler: Any = self.batch_sampler  # (in prediction, inside Lightning's wrapper that notes the indices)
        return getattr(sampler, "_batch_sampler", sampler)

    @property
    def global_batch_size(self) -> int | None:
        return getattr(self.replica_sampler.batch_sampler, "batch_size", None)

    def state_dict(self) -> dict[str, Any]:
        if self.progress is None:
            return {}
        return {
            "epoch": self.replica_sampler.epoch,
            "global_batches_done": int(self.progress()),
            "global_batch_size": self.global_batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        saved, current = state.get("global_batch_size"), self.global_batch_size
        if saved is not None and current is not None and saved != current:
            raise LayoutError(
                f"The checkpoint was trained with a global batch of {saved} samples but this run's DataLoader uses "
                f"batch_size={current}. Keep batch_size={saved} to continue the same training (the global batch does not "
                f"depend on the layout), or start a new run."
            )
        self.replica_sampler.resume(int(state["epoch"]), int(state["global_batches_done"]))


class TensorRows(TensorDataset):
    """A ``TensorDataset`` whose batches are taken with one ``index_select`` per tensor: the values, dtypes and
    shapes that ``default_collate`` stacks from one ``__getitem__`` per sample (a list with one tensor per field,
    in new memory), at a fraction of the cost per step. Used with :func:`already_collated`."""

    def __getitems__(self, indices: Sequence[int]) -> list[Tensor]:
        rows = torch.as_tensor(indices, dtype=torch.long)
        return [tensor.index_select(0, rows) for tensor in self.tensors]


def already_collated(batch: Any) -> Any:
    """The collate function of a :class:`TensorRows` loader: its batches come whole."""
    return batch


def _fast_rows(loader: DataLoader) -> tuple[Any, Callable[[Any], Any]]:
    """The dataset and collate function of the sharded loader: :class:`TensorRows` for a plain ``TensorDataset``
    (or a ``Subset`` of one, as ``random_split`` makes) whose loader collates by default; a subclass or a collate
    function of the user's is kept as it is."""
    dataset = loader.dataset
    if loader.collate_fn is not default_collate:
        return dataset, loader.collate_fn
    if type(dataset) is TensorDataset:
        return TensorRows(*dataset.tensors), already_collated
    if type(dataset) is Subset and type(dataset.dataset) is TensorDataset:  # (Subset reads its rows in one call)
        return Subset(TensorRows(*dataset.dataset.tensors), dataset.indices), already_collated
    return dataset, loader.collate_fn


def _layout_free_sampler(sampler: Any, seed: int) -> Any:
    if (
        isinstance(sampler, RandomSampler)
        and sampler.generator is None
        and not sampler.replacement
        and sampler._num_samples is None
    ):
        return EpochShuffleSampler(sampler.data_source, seed)
    return sampler


def shard_dataloader(
    loader: DataLoader,
    *,
    dp_rank: int,
    dp_size: int,
    divisor: int | None,
    seed: int,
    progress: Callable[[], int] | None = None,
    world_size: int | None = None,
    weights: Sequence[int] | None = None,
) -> ShardedDataLoader:
    """A copy of ``loader`` that yields this replica's share of each global batch (in proportion to ``weights``)."""
    from torch.utils.data import IterableDataset

    if isinstance(loader.dataset, IterableDataset):
        raise LayoutError(
            "shard_dataloader shards map-style datasets by index; an IterableDataset cannot be sharded that way: "
            "lightning_spot.data.streams.stream_dataloader reads it (spot_pipeline does so itself, docs/streaming.md)."
        )
    batch_sampler: Any = loader.batch_sampler
    # prediction: Lightning's wrapper notes each batch's dataset indices (for prediction writers); it wraps this
    # replica's batches instead, so that they are the indices of the replica's rows
    indexing: Any = type(batch_sampler) if type(batch_sampler).__name__ == "_IndexBatchSamplerWrapper" else None
    if indexing is not None:
        batch_sampler = batch_sampler._batch_sampler
    if batch_sampler is None:
        raise LayoutError(
            "spot_pipeline needs a DataLoader with a batch size (batch_size=None is not supported): "
            "its batch_size is the global batch that the layout splits into replicas and micro-batches."
        )
    if type(batch_sampler) is BatchSampler:
        batch_sampler = BatchSampler(
            _layout_free_sampler(whole_dataset_order(batch_sampler.sampler), seed),
            batch_sampler.batch_size,
            batch_sampler.drop_last,
        )
    dataset, collate_fn = _fast_rows(loader)
    kwargs: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "collate_fn": collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": replica_worker_init(loader.worker_init_fn, dp_rank),
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
    }
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    replica: Any = ReplicaBatchSampler(batch_sampler, dp_rank, dp_size, divisor, world_size, weights)
    replica.draw_seed = seed if draws_from_process(batch_sampler, (EpochShuffleSampler,)) else None
    sharded = ShardedDataLoader(dataset, batch_sampler=indexing(replica) if indexing else replica, **kwargs)
    sharded.progress = progress
    sharded.draw_seed = None if collate_fn is already_collated else seed
    sharded.dp_rank = dp_rank
    return sharded
