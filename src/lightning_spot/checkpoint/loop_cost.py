"""What a background write (a snapshot, an upload) costs the training loop, measured on the loop's own steps.

    loop = LoopSteps()
    loop.step_ended(time.monotonic())          # SpotCheckpoint's step-end hook, before its own save work
    loop.back_to_training(time.monotonic())    # ... and after it
    loop.cost(start, end)                      # seconds the steps overlapping [start, end] took beyond the usual

A write costs the loop what the steps it overlaps take beyond the steps before it that overlapped no write: the
median step of each, times the steps overlapped. Counting the writer's CPU time instead is right where cores are
scarce (two-core machines: the writer competes with the training thread) but far too pessimistic on a GPU host
with cores to spare: there a 5 GB snapshot took 9 s of CPU and slowed the loop by a few percent, and snapshots
were spaced 15 minutes apart for it.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable

#: steps before a write that make its baseline (the most recent clean ones), and the fewest that do
BASELINE_STEPS, MIN_BASELINE_STEPS = 32, 3


class LoopSteps:
    """The training loop's steps as (start, end) on the monotonic clock, SpotCheckpoint's own save work excluded."""

    def __init__(self, keep: int = 2048) -> None:
        self._steps: deque[tuple[float, float]] = deque(maxlen=keep)
        self._writes: deque[tuple[float, float]] = deque(maxlen=64)  # finished writes, for clean baselines
        self._since: float | None = None

    def step_ended(self, now: float) -> None:
        if self._since is not None:
            self._steps.append((self._since, now))
        self._since = None

    def back_to_training(self, now: float) -> None:
        self._since = now

    def cost(self, start: float, end: float, running: Iterable[float] = ()) -> float | None:
        """Seconds the write in ``[start, end]`` cost the loop's steps (its copy on the training thread not
        included); ``None`` without enough clean steps before it to compare with. ``running``: the starts of
        writes still going on (their steps are not clean either)."""
        self._writes.append((start, end))
        busy = [*self._writes, *((s, math.inf) for s in running)]
        overlapped = [(s, e, _overlap(s, e, start, end)) for s, e in self._steps if _overlap(s, e, start, end) > 0]
        if not overlapped:
            return 0.0
        clean = [e - s for s, e in self._steps if e <= start and not any(_overlap(s, e, *w) > 0 for w in busy)]
        if len(clean) < MIN_BASELINE_STEPS:
            return None
        usual = statistics.median(clean[-BASELINE_STEPS:])
        slower = statistics.median(e - s for s, e, _ in overlapped) - usual
        steps = sum(o / (e - s) for s, e, o in overlapped)
        return max(0.0, slower) * steps


def _overlap(s: float, e: float, start: float, end: float) -> float:
    return min(e, end) - max(s, start) if e > s else 0.0
