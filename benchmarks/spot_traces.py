"""Node-availability traces of spot instances: read them and turn them into join / leave events.

    trace = load_trace("aws-spot-instances-g4dn-xlarge-us-east-1c-2020-11-20-1930-to-2020-11-21-2200")
    trace.at(3600.0)                      # instances running one hour in
    trace.events(cap=4)                   # [(seconds, +1 / -1), ...] for a replay capped at 4 nodes
    fixed_rate(nodes=4, every_seconds=600, duration_seconds=3600)   # Oobleck's case: one node lost every 10 min

The shipped traces (``benchmarks/data/spot_traces/``, from Bamboo; see the README there) are step functions
``time,instances``. ``python benchmarks/spot_traces.py`` prints a summary of each.
"""

from __future__ import annotations

import bisect
import sys
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "spot_traces"
#: traces whose time column is in hours (the others are in seconds)
HOURS = {"aws-spot-instances-p2-xlarge-2020-11-20-to-2020-11-23"}


@dataclass(frozen=True)
class Trace:
    """Instances available over time: ``counts[i]`` from ``times[i]`` (seconds) on."""

    name: str
    times: tuple[float, ...]
    counts: tuple[int, ...]

    @property
    def duration(self) -> float:
        return self.times[-1] if self.times else 0.0

    def at(self, seconds: float) -> int:
        """Instances running at ``seconds`` (the last value set at or before it)."""
        i = bisect.bisect_right(self.times, seconds) - 1
        return self.counts[i] if i >= 0 else 0

    def events(self, cap: int | None = None) -> list[tuple[float, int]]:
        """(seconds, change) for every change of the running count, capped at ``cap`` nodes (a replay on a machine
        that holds fewer): ``+1`` a node joins, ``-1`` one leaves."""
        out: list[tuple[float, int]] = []
        current = 0
        for t, n in zip(self.times, self.counts):
            n = min(n, cap) if cap is not None else n
            while current < n:
                out.append((t, +1))
                current += 1
            while current > n:
                out.append((t, -1))
                current -= 1
        return out


def load_trace(name: str) -> Trace:
    """A shipped trace by file name (without ``.csv``), times in seconds."""
    path = DATA / f"{name}.csv"
    scale = 3600.0 if name in HOURS else 1.0
    times, counts = [], []
    for line in path.read_text().splitlines():
        if line.strip():
            t, n = line.split(",")
            times.append(float(t) * scale)
            counts.append(int(n))
    # several lines at one instant: the last one holds
    merged: dict[float, int] = {}
    for t, n in zip(times, counts):
        merged[t] = n
    ordered = sorted(merged)
    return Trace(name, tuple(ordered), tuple(merged[t] for t in ordered))


def fixed_rate(nodes: int, every_seconds: float, duration_seconds: float) -> Trace:
    """Oobleck's setting: start with ``nodes`` and lose one every ``every_seconds`` (never below one)."""
    times, counts = [0.0], [nodes]
    t, n = every_seconds, nodes
    while t <= duration_seconds and n > 1:
        n -= 1
        times.append(t)
        counts.append(n)
        t += every_seconds
    return Trace(f"fixed-rate-{nodes}-every-{every_seconds:g}s", tuple(times), tuple(counts))


def shipped() -> list[str]:
    return sorted(p.stem for p in DATA.glob("*.csv"))


def main() -> int:
    for name in shipped():
        trace = load_trace(name)
        events = trace.events()
        leaves = sum(1 for _, c in events if c < 0)
        print(
            f"{name}: {trace.duration / 3600:.1f} h, up to {max(trace.counts)} instances, "
            f"{leaves} leaves, {len(events) - leaves} joins; capped at 4: {len(trace.events(cap=4))} events"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
