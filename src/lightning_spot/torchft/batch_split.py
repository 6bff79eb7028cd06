"""Each replica's part of a global batch in a quorum: whole micro-batches, as equal as they can be."""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.utils._pytree import tree_map

from lightning_spot.data.sharded import replica_slice
from lightning_spot.layout import LayoutError


def participant_rows(size: int, microbatches: int, rank: int, count: int) -> slice:
    """The rows of a global batch of ``size`` samples that participant ``rank`` of ``count`` trains.

    Shares are whole multiples of ``microbatches`` (each pipeline runs that many equal micro-batches), so that
    the replicas' gradients, weighted by their samples, add up to the gradient of the whole batch."""
    if size % microbatches:
        raise LayoutError(
            f"a global batch of {size} samples cannot be cut into micro-batches of equal size for microbatches="
            f"{microbatches}; use a batch_size that is a multiple of {microbatches}"
        )
    units = size // microbatches
    if units < count:
        raise LayoutError(
            f"{count} pipelines share a global batch of {size} samples, which holds only {units} groups of "
            f"microbatches={microbatches}: use a batch_size of at least {count * microbatches}, or drop_last=True if "
            f"only the last batch is this short"
        )
    part = replica_slice(units, rank, count)
    return slice(part.start * microbatches, part.stop * microbatches)


def take_rows(batch: Any, rows: slice, size: int) -> Any:
    """``batch`` (tensors, lists, dicts, tuples) with only ``rows`` of every leaf that has ``size`` rows."""

    def take(leaf: Any) -> Any:
        if isinstance(leaf, Tensor) and leaf.dim() > 0 and leaf.shape[0] == size:
            return leaf[rows]
        return leaf

    return tree_map(take, batch)
