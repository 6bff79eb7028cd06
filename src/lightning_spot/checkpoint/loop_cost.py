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

#: steps before a write that make its baseline (the most recent clean ones), the fewest that do, and how far back
#: to look for them (the cost is computed on the training thread: it stays well under a millisecond)
BASELINE_STEPS, MIN_BASELINE_STEPS, LOOK_BACK = 32, 3, 256


class LoopSteps:
    """The training loop's steps as (start, end) on the monotonic clock, SpotCheckpoint's own save work excluded."""

    def __init__(self, keep: int = 2048) -> None:
        self._steps: deque[tuple[float, float]] = deque(maxlen=keep)
        self._writes: deque[tuple[float, float]] = deque(maxlen=8)  # recent writes: their steps are not clean
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
        writes still going on (their steps are not clean either). The write is remembered: the steps it overlapped
        are no baseline for the next writes (call once per finished write)."""
        self._writes.append((start, end))
        busy = [*self._writes, *((s, math.inf) for s in running)]
        overlapped: list[tuple[float, float]] = []  # (step's duration, its time within the write)
        clean: list[float] = []
        looked = 0
        for s, e in reversed(self._steps):  # newest first: the write's steps, then the ones before it
            if s >= end or e <= s:
                continue
            if e > start:
                overlapped.append((e - s, min(e, end) - max(s, start)))
                continue
            looked += 1
            if looked > LOOK_BACK or len(clean) == BASELINE_STEPS:
                break
            if not any(_overlap(s, e, *w) > 0 for w in busy):
                clean.append(e - s)
        if not overlapped:
            return 0.0
        if len(clean) < MIN_BASELINE_STEPS:
            return None
        slower = statistics.median(d for d, _ in overlapped) - statistics.median(clean)
        return max(0.0, slower) * sum(o / d for d, o in overlapped)


def _overlap(s: float, e: float, start: float, end: float) -> float:
    return min(e, end) - max(s, start) if e > s else 0.0
