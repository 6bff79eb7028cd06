"""Mode "global stream": every replica reads the whole stream in global batches and keeps its share of each.

The state a checkpoint records is the stream's position after the last *trained* global batch: the position is
taken before each global batch is read, and ``state_dict`` picks the one for the number of batches the loop has
trained (Lightning reads one batch ahead, so the stream's current position is one batch too far).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_map
from torch.utils.data import DataLoader

from lightning_spot.data.sharded import explain_indivisible_batch, replica_slice, valid_global_batches
from lightning_spot.data.streams.contract import check_stream, release_workers
from lightning_spot.data.streams.positions import PositionLog
from lightning_spot.layout import LayoutError


def batch_rows(batch: Any) -> int:
    """The number of samples in a collated batch: the first dimension of its first tensor (or list)."""
    found: list[int] = []

    def visit(x: Any) -> Any:
        if not found and isinstance(x, torch.Tensor) and x.dim():
            found.append(int(x.shape[0]))
        return x

    tree_map(visit, batch)
    if not found:
        raise LayoutError("a stream's batch holds no tensor with a batch dimension: nothing to split among replicas")
    return found[0]


def slice_batch(batch: Any, rows: int, part: slice) -> Any:
    """Rows ``part`` of every tensor (and list) of a collated batch of ``rows`` samples."""

    def cut(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == rows:
            return x[part]
        return x

    if isinstance(batch, list) and len(batch) == rows and not any(isinstance(x, torch.Tensor) for x in batch):
        return batch[part]
    return tree_map(cut, batch)


class GlobalStreamLoader:
    """This replica's share of every global batch of a stateful stream (Lightning's stateful-loader protocol:
    its state is the stream's position after the trained global batches, the same on every layout)."""

    def __init__(
        self,
        loader: DataLoader,
        *,
        dp_rank: int,
        dp_size: int,
        divisor: int | None,
        progress: Callable[[], int] | None = None,
        weights: Sequence[int] | None = None,
        world_size: int | None = None,
    ) -> None:
        self.loader = loader
        self.dataset: Any = loader.dataset
        self.source = self._position_source(loader)  # what saves and takes the stream's position
        self.dp_rank, self.dp_size, self.divisor = dp_rank, dp_size, divisor
        self.weights = list(weights) if weights is not None else None
        self.world_size = world_size
        self.progress = progress
        self.batch_size = loader.batch_size
        self._log = PositionLog()  # the stream's position before each of the pass's last global batches
        self._pending: dict[str, Any] | None = None

    def _position_source(self, loader: DataLoader) -> Any:
        return check_stream(loader)

    @property
    def sampler(self) -> Any:
        """What Lightning calls ``set_epoch`` on at each epoch's start: passed on to a dataset that has it (a shuffle
        that changes per epoch, e.g. a Hugging Face streaming dataset), as ``DistributedSampler`` gets it."""
        return self.dataset if callable(getattr(self.dataset, "set_epoch", None)) else None

    def __iter__(self) -> Iterator[Any]:
        if self._pending is not None:  # (saved after a pass's last batch, Lightning starts its next epoch itself)
            pending, self._pending = self._pending, None
            self.source.load_state_dict(pending["stream"])
            done = int(pending["global_batches_done"])
        else:
            done = 0
        self._log.restart(done, copy.deepcopy(self.source.state_dict()))
        source = iter(self.loader)
        while True:
            try:
                batch = next(source)
            except StopIteration:
                return
            self._log.record(copy.deepcopy(self.source.state_dict()))  # (the position before the next)
            yield self._share(batch)

    def close(self) -> None:
        """The end of the fit: the wrapped loader's worker processes are shut down now."""
        release_workers(self.loader)

    def mirror(self) -> dict[str, Any]:
        """What :meth:`state_dict` answers from, for a stage that receives the batches instead of reading them: the
        batches read and the newest two positions (the others were sent with the batches before)."""
        return self._log.mirror()

    def take_mirror(self, fields: dict[str, Any], fresh: bool) -> None:
        """Take :meth:`mirror` of the loader that read the batches (``fresh``: the first of a pass)."""
        self._pending = None
        self._log.take(fields, fresh)

    def _share(self, batch: Any) -> Any:
        rows = batch_rows(batch)
        if self.divisor is not None and rows % self.divisor:
            if self.weights is not None:
                raise LayoutError(
                    f"A global batch of {rows} samples cannot be cut into the {self.divisor} equal micro-batches "
                    f"that the pipelines of mixed depths run; use a batch_size that is a multiple of {self.divisor} "
                    f"(e.g. {valid_global_batches(self.divisor, rows)}), or drop_last=True."
                )
            m = self.divisor // self.dp_size
            raise LayoutError(explain_indivisible_batch(rows, self.dp_size, m if m > 1 else None, self.world_size))
        part = replica_slice(rows, self.dp_rank, self.dp_size, self.weights)
        if part.stop <= part.start:
            raise LayoutError(
                f"A batch of {rows} samples is too small for the {self.dp_size} data-parallel replicas; use a larger "
                f"batch_size or drop_last=True."
            )
        return slice_batch(batch, rows, part)

    def state_dict(self) -> dict[str, Any]:
        if self.progress is None:
            return {}
        done = int(self.progress())
        log = self._log
        if done in log.positions:
            position = log.positions[done]
        elif not log.positions and done == log.next:  # never read
            position = copy.deepcopy(self.source.state_dict())
        else:
            raise RuntimeError(f"the stream's position after {done} global batches was not kept (read {log.next})")
        return {
            "mode": "global stream",
            "global_batches_done": done,
            "global_batch_size": self.batch_size,
            "stream": position,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        if state.get("mode") != "global stream":
            raise LayoutError(
                "the checkpoint's data position is not a global stream's (it was trained on a map-style Dataset or "
                "another kind of stream): resume with the same kind of training data"
            )
        saved = state.get("global_batch_size")
        if saved is not None and saved != self.batch_size:
            raise LayoutError(
                f"The checkpoint was trained with a global batch of {saved} samples but this run's DataLoader uses "
                f"batch_size={self.batch_size}. Keep batch_size={saved} to continue the same training."
            )
        self._pending = state
