"""How often to snapshot and to save durably when the user did not say: chosen from measured costs and the run's
own interruption rate, re-evaluated as the run goes.

    cadence = Cadence(snapshot_steps=None, snapshot_seconds=None, durable_steps=None, durable_minutes=None,
                      snapshots=True)
    cadence.set_history(exposure_seconds=5400.0, interruptions=2)    # from the run history (rank 0)
    cadence.observe_snapshot(cost=0.012, wall=0.05)                   # each finished snapshot
    cadence.observe_durable(cost=0.03, wall=0.4)                      # each committed durable save
    cadence.snapshot_every()   # seconds between snapshots (None: by steps, or no snapshots)
    cadence.durable_every()    # seconds between durable saves (None: by steps only)

* **Snapshots** cost the training loop their copy (the training thread's stall) and what their background write
  slows the steps it overlaps (:mod:`~lightning_spot.checkpoint.loop_cost`); they are taken as often as
  :data:`SNAPSHOT_BUDGET` of the loop time allows: every ``cost / budget`` seconds, and never more often than twice
  their background write takes.
* **Durable saves** are taken at the Young-Daly interval ``sqrt(2 x cost x MTBF)`` (Young 1974, Daly 2006: the
  interval that minimises checkpoint cost plus expected lost work), where MTBF is the run's mean time between
  interruptions: its exposure (running time in the history) plus a prior of :data:`MTBF_PRIOR_SECONDS`, over its
  interruptions plus one. Never more often than twice an upload takes.

The first snapshot and the first durable save of a run pay one-time costs (page-locking host buffers on GPUs:
seconds for a few GB; creating spare files): once a second one of the kind is measured, the first no longer counts,
and the second snapshot is taken soon after the first (once its write is done) to measure the steady cost.

Explicit intervals win: a kind with an interval given by the user is not chosen.

The choice is announced (one log line, one journal record) once it rests on steady measurements, and again only
when it moves by more than a factor of 2 (:meth:`Cadence.worth_saying`).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

#: the share of the training loop's time that automatic snapshots may cost
SNAPSHOT_BUDGET = 0.01
#: the mean time between interruptions assumed before a run has any history (one hour: a multi-node spot job;
#: a single spot VM is interrupted far less often, so the prior errs on the side of saving)
MTBF_PRIOR_SECONDS = 3600.0
#: the cost of a durable save assumed before one has been measured (or a snapshot, which it includes)
DURABLE_COST_PRIOR = 1.0
#: automatic intervals stay within these bounds (seconds)
MIN_SECONDS, MAX_DURABLE_SECONDS = 1.0, 3600.0


class _Costs:
    """The last few measurements (cost, wall) of one kind; the run's first makes way for the second (it paid the
    one-time costs)."""

    def __init__(self) -> None:
        self._recent: deque[tuple[float, float]] = deque(maxlen=5)
        self._seen = 0

    def add(self, cost: float, wall: float) -> None:
        if self._seen == 1:
            self._recent.clear()
        self._recent.append((cost, wall))
        self._seen += 1

    @property
    def first_only(self) -> bool:
        """Whether the one measurement is the run's first."""
        return self._seen == 1

    def __bool__(self) -> bool:
        return bool(self._recent)

    def median(self) -> tuple[float, float]:
        return statistics.median(p[0] for p in self._recent), statistics.median(p[1] for p in self._recent)


@dataclass
class Cadence:
    """The snapshot and durable-save intervals of a run: the user's, or chosen (see the module docstring)."""

    snapshot_steps: int | None
    snapshot_seconds: float | None
    durable_steps: int | None
    durable_minutes: float | None
    snapshots: bool
    exposure_seconds: float = 0.0
    interruptions: int = 0
    _snapshot_costs: _Costs = field(default_factory=_Costs)
    _durable_costs: _Costs = field(default_factory=_Costs)

    @property
    def auto_snapshots(self) -> bool:
        return self.snapshots and self.snapshot_steps is None and self.snapshot_seconds is None

    @property
    def auto_durable(self) -> bool:
        return self.durable_steps is None and self.durable_minutes is None

    @property
    def timed(self) -> bool:
        """Whether any interval is in seconds (then the ranks agree on elapsed time every step)."""
        return self.snapshot_every() is not None or self.durable_every() is not None

    def set_history(self, exposure_seconds: float, interruptions: int) -> None:
        self.exposure_seconds, self.interruptions = exposure_seconds, interruptions

    def observe_snapshot(self, cost: float, wall: float) -> None:
        """A finished snapshot: what it cost the loop (stall + slower steps) and how long its writing took."""
        self._snapshot_costs.add(cost, wall)

    def observe_durable(self, cost: float, wall: float) -> None:
        """A committed durable save: its cost to the loop and how long the upload took."""
        self._durable_costs.add(cost, wall)

    @property
    def measured(self) -> bool:
        """Whether an automatic interval rests on a measurement (a snapshot or durable save has finished)."""
        return bool(
            (self.auto_snapshots and self._snapshot_costs)
            or (self.auto_durable and (self._durable_costs or self._snapshot_costs))
        )

    @property
    def mtbf_seconds(self) -> float:
        """The run's mean time between interruptions (the prior counts as one more interval)."""
        return (self.exposure_seconds + MTBF_PRIOR_SECONDS) / (self.interruptions + 1)

    def snapshot_every(self) -> float | None:
        if self.snapshot_seconds is not None:
            return self.snapshot_seconds
        if not self.auto_snapshots:
            return None
        if not self._snapshot_costs:
            return MIN_SECONDS  # the first one is taken soon, to measure
        if self._snapshot_costs.first_only:  # it paid one-time costs: the second, soon, measures the steady cost
            return max(MIN_SECONDS, 2 * self._snapshot_costs.median()[1])
        cost, wall = self._snapshot_costs.median()
        return max(MIN_SECONDS, cost / SNAPSHOT_BUDGET, 2 * wall)

    @property
    def settled(self) -> bool:
        """Whether the automatic intervals rest on steady measurements: none on a run's first snapshot or first
        durable save alone (they paid one-time costs, and the next one measures again)."""
        snapshots = self.auto_snapshots and self._snapshot_costs.first_only
        durable = self.auto_durable and (
            self._durable_costs.first_only or (not self._durable_costs and self._snapshot_costs.first_only)
        )
        return self.measured and not (snapshots or durable)

    def worth_saying(self, said: tuple[float | None, float | None]) -> tuple[float | None, float | None] | None:
        """The (snapshot, durable) intervals to announce now, given those announced before (``(None, None)``: none
        yet), or ``None``: the choice rests on a first measurement alone, or moved by a factor of 2 or less (measured
        costs wander; a line each time would tell nothing)."""
        if not self.settled:
            return None
        chosen = self.chosen()
        intervals = (chosen["snapshot_seconds"], chosen["durable_seconds"])
        for now, then in zip(intervals, said):
            if (now is None) != (then is None) or (now and then and not 0.5 <= now / then <= 2.0):
                return intervals
        return None

    def durable_cost(self) -> float:
        if self._durable_costs:
            return self._durable_costs.median()[0]
        if self._snapshot_costs:  # a durable save from snapshots costs at least a snapshot
            return self._snapshot_costs.median()[0]
        return DURABLE_COST_PRIOR

    def durable_every(self) -> float | None:
        if self.durable_minutes is not None:
            return 60.0 * self.durable_minutes
        if not self.auto_durable:
            return None
        young_daly = math.sqrt(2 * self.durable_cost() * self.mtbf_seconds)
        wall = self._durable_costs.median()[1] if self._durable_costs else 0.0
        return min(MAX_DURABLE_SECONDS, max(MIN_SECONDS, young_daly, 2 * wall))

    def describe(self) -> str:
        """One line: the intervals and why."""
        parts = []
        snap = self.snapshot_every()
        if self.auto_snapshots and snap is not None:
            cost = self._snapshot_costs.median()[0] if self._snapshot_costs else None
            if cost is None:
                why = "the first one, to measure its cost"
            elif self._snapshot_costs.first_only:
                why = f"the first cost the loop {1000 * cost:.1f} ms with its one-time setup: the second measures again"
            else:
                why = f"a snapshot costs the loop {1000 * cost:.1f} ms, budget {100 * SNAPSHOT_BUDGET:g}% of its time"
            parts.append(f"snapshots every {snap:.1f}s ({why})")
        durable = self.durable_every()
        if self.auto_durable and durable is not None:
            seen = (
                f"{self.interruptions} interruption(s) in {self.exposure_seconds / 3600:.2f} h of this run"
                if self.interruptions
                else f"no interruption of this run yet: the prior, {MTBF_PRIOR_SECONDS / 3600:g} h"
            )
            parts.append(
                f"durable checkpoints every {durable:.0f}s (Young-Daly: a save costs {self.durable_cost():.3f}s, "
                f"mean time between interruptions {self.mtbf_seconds / 3600:.2f} h, {seen})"
            )
        return "; ".join(parts)

    def chosen(self) -> dict[str, float | None]:
        """The automatic intervals and their inputs (for the run history)."""
        return {
            "snapshot_seconds": self.snapshot_every() if self.auto_snapshots else None,
            "durable_seconds": self.durable_every() if self.auto_durable else None,
            "durable_cost_seconds": round(self.durable_cost(), 4),
            "mtbf_seconds": round(self.mtbf_seconds, 1),
            "interruptions": self.interruptions,
        }
