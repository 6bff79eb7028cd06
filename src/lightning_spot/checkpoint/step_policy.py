"""What ``SpotCheckpoint`` does at the end of an optimizer step: stop for a notice, save, snapshot, or nothing.

    policy = StepPolicy(every_n_train_steps=None, snapshot_every_n_train_steps=None, snapshots=True,
                        save_on_train_end=True)
    agreed = Agreed(notice=False, snapshot_elapsed=3.1, snapshot_every=2.0, durable_elapsed=40.0,
                    durable_every=600.0, writing=False)          # the largest values over the ranks
    decision = policy.decide(step=120, agreed=agreed, ending=False)
    decision.save, decision.snapshot, decision.stop_for_notice   # None, True, False

Pure: no Trainer, no collective, no I/O (the callback posts and reads the agreement, and carries the decision
out). Every rank decides alike from the same agreed values and step.

* A notice seen by any rank stops every rank (the callback's coordinated stop saves first).
* A durable save is due every ``every_n_train_steps`` steps, or once ``durable_every`` seconds have passed since
  the last one; at the end of training (``ending``: ``max_steps`` reached or ``should_stop`` set) with
  ``save_on_train_end``.
* Otherwise a snapshot is due every ``snapshot_every_n_train_steps`` steps, or once ``snapshot_every`` seconds
  have passed, unless a rank is still writing the previous one: the snapshot then waits (its copy would wait for
  that write), and a wait of :data:`POSTPONED_WARN_SECONDS` or more is said once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger(__name__)

#: a snapshot postponed this long (a rank still writing the previous one) is warned about, once
POSTPONED_WARN_SECONDS = 300.0


@dataclass(frozen=True)
class Agreed:
    """What every rank agreed on at a step (each the largest over the ranks): a notice seen, seconds since the
    last snapshot and durable save, the intervals chosen, and whether a rank is still writing a snapshot."""

    notice: bool
    snapshot_elapsed: float
    snapshot_every: float
    durable_elapsed: float
    durable_every: float
    writing: bool

    def posted(self) -> list[float]:
        """This rank's values as posted to the agreement (a maximum over the ranks each)."""
        elapsed = [self.snapshot_elapsed, self.snapshot_every, self.durable_elapsed, self.durable_every]
        return [float(self.notice), *elapsed, float(self.writing)]

    @classmethod
    def of(cls, values: list[float]) -> Agreed:
        """From the agreed values (:meth:`posted`'s order)."""
        notice, snap_elapsed, snap_every, elapsed, durable_every, writing = values
        return cls(bool(notice), snap_elapsed, snap_every, elapsed, durable_every, bool(writing))


@dataclass(frozen=True)
class StepDecision:
    """What to do at a step's end: stop for a notice (first), a durable save (``"periodic"`` or ``"end"``), or a
    snapshot."""

    stop_for_notice: bool = False
    save: Optional[str] = None
    snapshot: bool = False


class StepPolicy:
    """The per-step decision of ``SpotCheckpoint`` (see the module's text)."""

    def __init__(
        self,
        every_n_train_steps: Optional[int],
        snapshot_every_n_train_steps: Optional[int],
        snapshots: bool,
        save_on_train_end: bool,
    ) -> None:
        self.every_n_train_steps = every_n_train_steps
        self.snapshot_every_n_train_steps = snapshot_every_n_train_steps
        #: whether snapshots are taken at all (a snapshot store is open)
        self.snapshots = snapshots
        self.save_on_train_end = save_on_train_end
        self._warned_postponed = False

    def decide(self, step: int, agreed: Optional[Agreed], ending: bool) -> StepDecision:
        """The decision at the end of optimizer step ``step`` (``agreed``: ``None`` at a step without an
        agreement; ``ending``: training ends with this step)."""
        due = bool(self.every_n_train_steps) and step % self.every_n_train_steps == 0  # type: ignore[operator]
        snap_due = self.snapshots and bool(self.snapshot_every_n_train_steps)
        snap_due = snap_due and step % self.snapshot_every_n_train_steps == 0  # type: ignore[operator]
        notice = False
        if agreed is not None:
            notice = agreed.notice
            due = due or (agreed.durable_every > 0 and agreed.durable_elapsed >= agreed.durable_every)
            late = self.snapshots and agreed.snapshot_every > 0 and agreed.snapshot_elapsed >= agreed.snapshot_every
            snap_due = snap_due or (late and not self.postponed(agreed.writing, agreed.snapshot_elapsed))
        ending = ending and self.save_on_train_end
        if due or ending:
            return StepDecision(stop_for_notice=notice, save="end" if ending and not due else "periodic")
        return StepDecision(stop_for_notice=notice, snapshot=snap_due)

    def postponed(self, writing: bool, elapsed: float) -> bool:
        """Whether a snapshot due by the clock waits for a rank still writing the previous one; says so once if the
        wait grows long (a writer stuck, e.g. on a peer copy: the memory tier then falls behind)."""
        if writing and elapsed >= POSTPONED_WARN_SECONDS and not self._warned_postponed:
            self._warned_postponed = True
            log.warning(
                "lightning-spot: no snapshot for %.0fs: a rank is still writing the previous one (host memory, or the "
                "copy to its peer node, is slower than the interval); the newest snapshot is that old",
                elapsed,
            )
        return writing
