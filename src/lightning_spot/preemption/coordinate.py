"""Agree across all ranks at a step boundary: a notice at any rank stops every rank together.

late, preempted = agree([timer_expired, watcher.notice is not None], device)   # one all-reduce (MAX)
first = earliest(gather(watcher.notice))
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from lightning_spot._dist import all_gather_object, world_size
from lightning_spot.preemption.notice import Notice


def agree(flags: Sequence[bool], device: torch.device) -> list[bool]:
    """Each flag is True on every rank if it is True on any rank (one small all-reduce on ``device``)."""
    return [bool(v) for v in max_over_ranks([float(f) for f in flags], device)]


def max_over_ranks(values: Sequence[float], device: torch.device) -> list[float]:
    """Each value's largest over all ranks, on every rank (one small all-reduce on ``device``, in float64)."""
    return PostedMax(values, device).result()


class PostedMax:
    """:func:`max_over_ranks` in two halves: posted now (no rank waits for the others here), read later.

    posted = PostedMax([notice, elapsed], device)   # at a step's start, on every rank
    notice, elapsed = posted.result()                # at its end: every rank has posted by then
    """

    def __init__(self, values: Sequence[float], device: torch.device) -> None:
        self._values = torch.tensor(list(values), dtype=torch.float64, device=device)
        self._work = dist.all_reduce(self._values, op=dist.ReduceOp.MAX, async_op=True) if world_size() > 1 else None

    def result(self) -> list[float]:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._values.tolist()


def gather(notice: Notice | None) -> list[Notice | None]:
    """Every rank's notice (or None), on every rank."""
    return all_gather_object(notice)


def earliest(notices: Sequence[Notice | None]) -> tuple[int, Notice] | None:
    """(rank, notice) of the notice with the earliest deadline (or, without deadlines, the first received)."""
    ranked = [(r, n) for r, n in enumerate(notices) if n is not None]
    if not ranked:
        return None
    return min(ranked, key=lambda rn: (rn[1].deadline if rn[1].deadline is not None else float("inf"), rn[1].received))
