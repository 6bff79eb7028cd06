"""The coordinated stop after a preemption notice: every rank saves the same step, then exits so that
the launcher restarts the job.

    late, preempted = agree([timer_expired, watcher.notice is not None], device)   # every step boundary
    if preempted:
        stop_for_preemption(watcher.notice, step=step, save=save_for, report=record)   # never returns

What "save" means is the caller's business (``SpotCheckpoint`` commits a checkpoint, or a snapshot in host memory
when the notice leaves less time than a checkpoint takes); this module
decides which notice counts, times the stop and exits with :data:`PREEMPTED_EXIT_CODE`.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

from lightning_spot.preemption.cloud import POLLERS
from lightning_spot.preemption.coordinate import earliest, gather
from lightning_spot.preemption.notice import PREEMPTED_EXIT_CODE, Notice
from lightning_spot_launch import AGENT_PID_ENV

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreemptionStop:
    """A finished coordinated stop: the notice that counted (the earliest deadline), on which rank, at
    which step, and how long saving took."""

    rank: int
    notice: Notice
    step: int
    save_seconds: float
    #: what the stop committed: a durable checkpoint, or (a notice shorter than a durable save) a host-memory snapshot
    saved: str = "checkpoint"

    def describe(self) -> str:
        left = self.notice.seconds_left()
        margin = f"; {left:.1f}s left before the deadline" if left is not None else ""
        return (
            f"preemption notice on rank {self.rank} ({self.notice.describe()}): {self.saved} of step {self.step} "
            f"committed in {self.save_seconds:.2f}s{margin}. Exiting with code {PREEMPTED_EXIT_CODE} so that the "
            f"launcher restarts the job."
        )

    def event(self) -> dict[str, object]:
        """The stop as a run-history event's fields."""
        left = self.notice.seconds_left()
        return {
            "step": self.step,
            "source": self.notice.source,
            "detail": self.notice.detail,
            "rank": self.rank,
            "notice_time": self.notice.received,
            "deadline": self.notice.deadline,
            "save_seconds": round(self.save_seconds, 3),
            "saved": self.saved,
            "seconds_left": None if left is None else round(left, 3),
        }


def stop_for_preemption(
    notice: Notice | None,
    *,
    step: int,
    save: Callable[[str, Notice], str | None],
    report: Callable[[PreemptionStop], None],
) -> NoReturn:
    """All ranks (collective): agree on the notice, ``save(reason, notice)`` (the notice that counts: its deadline
    may decide what to save; it returns what it committed, ``None``: a checkpoint), ``report`` the stop, then exit
    with :data:`PREEMPTED_EXIT_CODE` (torchrun restarts the group)."""
    start = time.time()
    found = earliest(gather(notice))
    if found is None:
        raise RuntimeError("stop_for_preemption was called although no rank has a preemption notice")
    rank, first = found
    saved = save(f"preempted: {first.source}", first)
    report(PreemptionStop(rank, first, step, time.time() - start, saved or "checkpoint"))
    leave_if_reclaimed(notice)
    raise SystemExit(PREEMPTED_EXIT_CODE)


def leave_if_reclaimed(notice: Notice | None) -> bool:
    """This rank's own cloud notice says its machine is being reclaimed: under torchrun, ask the node's agent
    (this worker's parent) to leave the job, as a SIGTERM to the agent would. Without that the agent restarts
    its workers, the node rejoins for the rest of its lead time and takes the group down a second time when the
    machine goes (replayed: 78.8 s from the notice to the next step instead of 10.3 s). A signal notice came
    through the agent already."""
    if notice is None or notice.source not in POLLERS or "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    log.warning(
        "lightning-spot: this machine is being reclaimed (%s): its torchrun agent leaves the job, the other "
        "nodes go on without it",
        notice.describe(),
    )
    os.kill(agent_pid(), signal.SIGTERM)
    return True


def agent_pid() -> int:
    """The torchrun agent of this worker: its parent, or the agent named by ``lightning-spot run``'s launcher
    (whose workers are forked by a fork server, their parent)."""
    return int(os.environ.get(AGENT_PID_ENV) or os.getppid())
