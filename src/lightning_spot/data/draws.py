"""Random draws in data loading that every rank of a pipeline makes alike.

Every stage of a pipeline reads the batch itself (each replays the user's step on it), so the stages must read
the same rows, drawn the same way. A sampler or dataset that draws from the process's random generators
(``WeightedRandomSampler``, ``RandomSampler(replacement=True)``, ``SubsetRandomSampler``, a random crop or
augmentation in ``__getitem__``) would draw differently on each rank: the first stage would forward one sample
while the last computed the loss against another one's target. Here such draws come from generators seeded by
(seed, epoch, batch, replica), and the process's own generators are put back afterwards, so that the model's
draws (dropout) go on as they would have.

    with seeded_draws(draw_key(seed, epoch, batch, dp_rank)):
        batch = fetch(indices)
"""

from __future__ import annotations

import copy
import functools
import os
from typing import Any

from lightning.fabric.utilities.seed import pl_worker_init_function
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from torch.utils.data.dataloader import _SingleProcessDataLoaderIter

from lightning_spot.replay.draws import draw_key, seeded_draws


def whole_dataset_order(sampler: Any) -> Any:
    """A ``DistributedSampler`` (the user's own, made for ``trainer.world_size`` processes) as one for a single
    process: the whole dataset in its order (``shuffle``, ``seed``, ``set_epoch`` kept), which the replica sampler
    then splits over the data-parallel replicas; any other sampler as it is."""
    if not isinstance(sampler, DistributedSampler):
        return sampler
    whole = copy.copy(sampler)
    whole.num_replicas, whole.rank = 1, 0
    whole.num_samples = whole.total_size = len(sampler.dataset)  # type: ignore[arg-type]
    return whole


def replica_worker_init(worker_init_fn: Any, dp_rank: int) -> Any:
    """Lightning's worker seeding (``seed_everything(workers=True)``) mixes the process's global rank into each
    worker's seeds, so the stages of a pipeline would draw differently in their workers: it gets the replica's rank
    instead (the ranks of one pipeline alike, replicas apart). Lightning adds it to loaders without a
    ``worker_init_fn`` after the strategy has processed them (and only there): such a loader gets it here. Any
    other ``worker_init_fn`` is kept."""
    lightnings = isinstance(worker_init_fn, functools.partial) and worker_init_fn.func is pl_worker_init_function
    if lightnings or (worker_init_fn is None and int(os.environ.get("PL_SEED_WORKERS", 0))):
        return functools.partial(pl_worker_init_function, rank=dp_rank)
    return worker_init_fn


_OWN_GENERATOR = (RandomSampler, WeightedRandomSampler, SubsetRandomSampler)


def draws_from_process(batch_sampler: Any, known: tuple[type, ...] = ()) -> bool:
    """Whether iterating ``batch_sampler`` may draw from the process's random generators: anything but a plain
    ``BatchSampler`` around a sequential sampler, a ``DistributedSampler`` (seeded by its ``seed`` and epoch), one of
    ``known`` or torch's random samplers given a ``generator`` of their own."""
    if type(batch_sampler) is not BatchSampler:
        return True
    inner = batch_sampler.sampler
    if isinstance(inner, (SequentialSampler, DistributedSampler, *known)):
        return False
    return not (isinstance(inner, _OWN_GENERATOR) and inner.generator is not None)


class SeededFetches(_SingleProcessDataLoaderIter):
    """The loader's iterator without worker processes, each batch fetched under :func:`seeded_draws` with the key
    of (``seed``, the epoch, the batch's place in it, the replica): what ``__getitem__`` or ``collate_fn`` draw is the
    same on every stage of a pipeline."""

    def __init__(self, loader: Any, seed: int, epoch: int, dp_rank: int) -> None:
        super().__init__(loader)
        self._draws = (seed, epoch, dp_rank)

    def _next_data(self) -> Any:
        seed, epoch, dp_rank = self._draws
        with seeded_draws(draw_key(seed, epoch, self._num_yielded, dp_rank)):
            return super()._next_data()
