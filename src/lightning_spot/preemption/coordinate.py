"""Agree across all ranks at a step boundary: a notice at any rank stops every rank together.

late, preempted = agree([timer_expired, watcher.notice is not None], device)   # one all-reduce (MAX)
first = earliest(gather(watcher.notice))
cadence = AgreementCadence()   # which step boundaries post the per-step agreements
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from lightning_spot.preemption.notice import Notice
from lightning_spot.utils.distributed import all_gather_object, world_size


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
        # (an asynchronous copy, staged at once from pageable memory: a blocking one would wait for the device)
        self._values = torch.tensor(list(values), dtype=torch.float64).to(device, non_blocking=True)
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


class AgreementCadence:
    """Which step boundaries post an agreement (``SigtermAgreement``'s, ``SpotCheckpoint``'s): every boundary at
    first and while steps are slow; every ``every``-th once steps are short, so that a notice is still agreed within
    about :attr:`WINDOW` seconds (plus a step) while short steps skip most of the collectives (a small all-reduce
    over every rank and, on GPUs, a host-device sync: ~1-2% of a 40 ms CPU pipeline step).

    Each posted agreement carries this rank's proposal for the next interval (the steps that fit in the window, at
    most twice the current interval and at most :attr:`MOST`), negated: the agreement takes the largest value of
    each entry, so every rank gets the smallest proposal and all of them post on the same boundaries.

        if cadence.due():                                  # at every boundary, on every rank
            posted = cadence.post([notice, ...], device)   # with this rank's proposal
        ...
        notice, ... = cadence.read(posted)                 # the proposal taken off and agreed
    """

    #: seconds between two agreements once steps are short
    WINDOW = 0.25
    #: the most boundaries between two agreements
    MOST = 8

    def __init__(self) -> None:
        self.every = 1
        self._count = 0
        #: when this rank last posted an agreement (``time.monotonic``)
        self._posted: float | None = None

    def due(self) -> bool:
        """Called once at every step boundary, alike on every rank: whether this one posts an agreement."""
        self._count += 1
        return self._count >= self.every

    def post(self, values: Sequence[float], device: torch.device) -> PostedMax:
        """(On a boundary that is due) post ``values`` with this rank's proposal for the next interval."""
        return PostedMax([*values, self.proposal()], device)

    def read(self, posted: PostedMax) -> list[float]:
        """The values of :meth:`post`, each the largest over the ranks; the next interval is agreed on the way."""
        *values, proposal = posted.result()
        self.agreed(proposal)
        return values

    def proposal(self) -> float:
        """(When posting) this rank's next interval, negated; measured from the steps since the last posting."""
        now, steps, since = time.monotonic(), self._count, self._posted
        self._count, self._posted = 0, now
        if since is None:
            return -1.0
        per_step = (now - since) / max(steps, 1)
        fits = int(self.WINDOW / per_step) if per_step > 0 else self.MOST
        return -float(max(1, min(fits, 2 * self.every, self.MOST)))

    def agreed(self, proposal: float) -> None:
        """The posted agreement's value of :meth:`proposal` (the smallest over the ranks): the next interval."""
        self.every = max(1, round(-proposal))
