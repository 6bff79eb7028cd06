"""Per-rank timing of the pipeline: compute per step (always, for the bubble figure) and, when a
:class:`Timeline` is attached, every action as a trace event.

    clock = StepClock()                       # one per engine; costs two clock reads per chunk
    with clock.compute("forward", microbatch=3, stage=1): ...
    clock.timeline = Timeline(rank=0)         # now every span is also kept as an event
    clock.timeline.chrome_events()            # Chrome-trace / Perfetto "X" events

Events carry wall-clock microseconds so that the traces of several processes (and nodes with
synchronised clocks) line up when merged.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

#: the kinds of event a trace holds, in drawing order (the Gantt colours follow this)
CATEGORIES = (
    "forward",
    "backward",
    "weight",
    "recv",
    "send",
    "allreduce",
    "optimizer",
    "checkpoint",
    "preemption",
    "step",
)
COMPUTE = ("forward", "backward", "weight")


@dataclass
class Timeline:
    """The trace events of one rank (kept in memory until exported)."""

    rank: int
    events: list[dict[str, Any]] = field(default_factory=list)
    _wall0: float = field(default_factory=time.time)
    _perf0: float = field(default_factory=time.perf_counter)

    def micros(self, perf: float) -> float:
        """A ``time.perf_counter()`` reading as wall-clock microseconds."""
        return (self._wall0 + (perf - self._perf0)) * 1e6

    def add(self, name: str, cat: str, start: float, end: float, lane: str = "pipeline", **args: Any) -> None:
        """Record an action that ran from ``start`` to ``end`` (``perf_counter`` readings); thread-safe."""
        self.events.append(
            {
                "name": name,
                "cat": cat,
                "ph": "X",
                "ts": self.micros(start),
                "dur": max(0.0, (end - start) * 1e6),
                "pid": self.rank,
                "tid": lane,
                "args": args,
            }
        )

    @contextlib.contextmanager
    def span(self, name: str, cat: str, lane: str = "pipeline", **args: Any) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, cat, start, time.perf_counter(), lane, **args)

    def chrome_events(self) -> list[dict[str, Any]]:
        """The events, plus the metadata that names this rank's process in trace viewers."""
        meta = [
            {"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}},
            {"name": "process_sort_index", "ph": "M", "pid": self.rank, "args": {"sort_index": self.rank}},
        ]
        return meta + sorted(self.events, key=lambda e: e["ts"])


class StepClock:
    """Compute seconds of the current step on this rank, and the trace when a timeline is attached."""

    def __init__(self) -> None:
        self.timeline: Timeline | None = None
        self.compute_seconds = 0.0

    def reset(self) -> None:
        self.compute_seconds = 0.0

    @contextlib.contextmanager
    def compute(self, cat: str, **args: Any) -> Iterator[None]:
        """Time one forward / backward / weight-gradient chunk."""
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            self.compute_seconds += end - start
            if self.timeline is not None:
                name = f"{cat[0].upper()}{args.get('microbatch', '')}"
                self.timeline.add(name, cat, start, end, **args)

    def span(self, name: str, cat: str, lane: str = "pipeline", **args: Any) -> contextlib.AbstractContextManager:
        """A traced span when a timeline is attached; nothing otherwise."""
        if self.timeline is None:
            return contextlib.nullcontext()
        return self.timeline.span(name, cat, lane, **args)
