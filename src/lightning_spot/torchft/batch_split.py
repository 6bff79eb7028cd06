"""Each replica's part of a global batch in a quorum: whole micro-batches, as equal as they can be."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor
from torch.utils._pytree import tree_map

from lightning_spot.data.sharded import replica_slice
from lightning_spot.layout import LayoutError


def participant_rows(
    size: int, microbatches: int, rank: int, count: int, speeds: Sequence[float] | None = None
) -> slice:
    """The rows of a global batch of ``size`` samples that participant ``rank`` of ``count`` trains.

    Shares are whole multiples of ``microbatches`` (each pipeline runs that many equal micro-batches), so that
    the replicas' gradients, weighted by their samples, add up to the gradient of the whole batch; as equal as they
    can be, or with ``speeds`` (one per participant, the same on every rank) in proportion to them, at least one
    group of micro-batches each."""
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
    if speeds is None or len(speeds) != count or min(speeds) <= 0:
        part = replica_slice(units, rank, count)
        return slice(part.start * microbatches, part.stop * microbatches)
    shares = proportional_units(units, speeds)
    start = sum(shares[:rank])
    return slice(start * microbatches, (start + shares[rank]) * microbatches)


def proportional_units(units: int, speeds: Sequence[float]) -> list[int]:
    """``units`` split in proportion to ``speeds``, at least one each (largest remainders; ties to the lower index)."""
    count = len(speeds)
    spare = units - count  # (one each first)
    total = float(sum(speeds))
    exact = [spare * s / total for s in speeds]
    shares = [1 + int(e) for e in exact]
    left = units - sum(shares)
    order = sorted(range(count), key=lambda i: (-(exact[i] - int(exact[i])), i))
    for i in order[:left]:
        shares[i] += 1
    return shares


def take_rows(batch: Any, rows: slice, size: int) -> Any:
    """``batch`` (tensors, lists, dicts, tuples) with only ``rows`` of every leaf that has ``size`` rows."""

    def take(leaf: Any) -> Any:
        if isinstance(leaf, Tensor) and leaf.dim() > 0 and leaf.shape[0] == size:
            return leaf[rows]
        return leaf

    return tree_map(take, batch)
