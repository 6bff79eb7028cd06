"""GPU-time efficiency (goodput against the GPUs available) of a replayed run.

    efficiency = samples trained / samples the nodes up at each moment would have trained at the full cluster's
                 per-node speed
               = steps x seconds per step on the full cluster x its nodes / node-seconds up

The useful-time share (time on kept steps / wall time) scores a run whose broken pipelines idle, or whose joiner
sets up for seconds, as well as one where every node trains; this figure charges them. One node is one process
(one GPU) in the replays. With a fixed global batch, a cluster's step time shrinks with its nodes only when the
per-step work is shared: the replays run with ``--step-gpu-seconds`` for that.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def node_seconds(log: Sequence[dict[str, Any]], start: float, end: float) -> float:
    """Nodes up x seconds between replay times ``start`` and ``end``, from the replay's event log (each event's
    ``nodes``: how many are up after it; a notice counts as the node's end, as the trace says)."""
    total, up, since = 0.0, 0, 0.0
    for event in sorted(log, key=lambda e: e["time"]):
        if event["event"] == "reclaimed":
            continue  # (a metadata notice's node: it left the trace at its notice)
        total += up * _overlap(since, event["time"], start, end)
        up, since = int(event["nodes"]), event["time"]
    return total + up * _overlap(since, end, start, end)


def _overlap(a: float, b: float, start: float, end: float) -> float:
    return max(0.0, min(b, end) - max(a, start))


def peak_nodes(log: Sequence[dict[str, Any]]) -> int:
    """The most nodes up at once in the replay (its full cluster)."""
    return max((int(e["nodes"]) for e in log if e["event"] != "reclaimed"), default=0)


def efficiency(steps: float, full_step_seconds: float, peak: int, node_s: float) -> float | None:
    """Samples trained / samples the node-seconds up would train at the full cluster's per-node speed."""
    if node_s <= 0 or full_step_seconds <= 0 or peak <= 0:
        return None
    return steps * full_step_seconds * peak / node_s


def step_seconds_by_size(ended: Sequence[Sequence[float]]) -> dict[int, float]:
    """The median step time at each number of processes training, from ``(step, end time, processes)`` per step."""
    gaps: dict[int, list[float]] = {}
    for a, b in zip(ended, ended[1:]):
        if a[2] == b[2] and b[0] == a[0] + 1:
            gaps.setdefault(int(a[2]), []).append(b[1] - a[1])
    return {n: statistics.median(g) for n, g in gaps.items()}


def strictest(by_size: dict[int, float]) -> tuple[int, float] | None:
    """(processes, step seconds) of the size whose steps cost the fewest node-seconds: the reference of the strict
    efficiency (on this machine a smaller cluster is often faster per node: fewer processes share its cores)."""
    return min(by_size.items(), key=lambda kv: kv[0] * kv[1]) if by_size else None


def figures(steps: float, by_size: dict[int, float], peak: int, node_s: float) -> dict[str, Any]:
    """The efficiency at the full cluster's per-node speed, and the strict one (at the best per-node speed
    measured at any size), with what they were computed from."""
    full = by_size.get(peak)
    best = strictest(by_size)
    return {
        "gpu_time_efficiency": efficiency(steps, full, peak, node_s) if full else None,
        "gpu_time_efficiency_strict": efficiency(steps, best[1], best[0], node_s) if best else None,
        "node_seconds": node_s,
        "peak_nodes": peak,
        "full_cluster_step_seconds": full,
        "step_seconds_by_size": by_size,
    }
