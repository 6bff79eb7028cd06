"""The measured costs of finished saves and snapshots, fed to the run's ``Cadence`` as their writes end.

    feed = CostFeed(cadence)
    said = feed.observe(saver)     # each step's end: the new records; a line to say when the intervals moved much

A record counts once its background write is over and was timed; what it cost the loop is its stall plus how much
slower the steps its write overlapped were (``Saver.loop_cost``).
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_spot.checkpoint.cadence import Cadence
from lightning_spot.checkpoint.saver import Saver


class CostFeed:
    """What the cadence has been given of a saver's records, and the intervals last said."""

    def __init__(self, cadence: Cadence) -> None:
        self.cadence = cadence
        #: how many snapshot and save records the cadence has been given (each is timed once its writing is over)
        self._snapshots_observed = self._saves_observed = 0
        self._said: tuple[Optional[float], Optional[float]] = (None, None)

    def observe(self, saver: Saver) -> Optional[str]:
        """Feed newly finished snapshots and saves to the cadence; the line that says the intervals when they
        moved much (``Cadence.worth_saying``), else ``None``."""
        taken = saver.snapshotter.taken if saver.snapshotter is not None else []
        snapshots, self._snapshots_observed = finished(taken, self._snapshots_observed)
        saves, self._saves_observed = finished(saver.saves, self._saves_observed)
        for record in snapshots:
            self.cadence.observe_snapshot(saver.loop_cost(record), record["write_seconds"])
        for record in saves:
            self.cadence.observe_durable(saver.loop_cost(record), record["write_seconds"])
        if not (snapshots or saves):
            return None  # the intervals move only with new measurements
        intervals = self.cadence.worth_saying(self._said)
        if intervals is None:
            return None
        self._said = intervals
        return f"SpotCheckpoint: {self.cadence.describe()}"


def finished(records: list[dict[str, Any]], start: int) -> tuple[list[dict[str, Any]], int]:
    """The records from ``start`` whose background writing is over and was timed, and where to start next time.
    One write runs at a time and a new record waits for the previous write, so every record but the newest is
    over; one without a time (a dropped snapshot, a failed save) is skipped."""
    end = len(records) if records and "cpu_seconds" in records[-1] else max(start, len(records) - 1)
    return [r for r in records[start:end] if "cpu_seconds" in r], end
