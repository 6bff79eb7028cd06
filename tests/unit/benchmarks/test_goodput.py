"""GPU-time efficiency of a replay (``benchmarks/goodput.py``): node-seconds from the event log, the reference
step times per size, the figure by hand."""

from __future__ import annotations

import pytest

from benchmarks.goodput import figures, node_seconds, peak_nodes, step_seconds_by_size

LOG = [
    {"time": 0.0, "event": "join", "nodes": 1},
    {"time": 0.0, "event": "join", "nodes": 2},
    {"time": 10.0, "event": "leave", "nodes": 1},
    {"time": 12.0, "event": "reclaimed", "nodes": 1},  # (its notice already counted it out)
    {"time": 20.0, "event": "join", "nodes": 2},
]


def test_node_seconds_integrate_the_nodes_up_over_the_window() -> None:
    assert node_seconds(LOG, 0.0, 30.0) == pytest.approx(2 * 10 + 1 * 10 + 2 * 10)
    assert node_seconds(LOG, 5.0, 25.0) == pytest.approx(2 * 5 + 1 * 10 + 2 * 5)
    assert peak_nodes(LOG) == 2


def test_efficiency_is_samples_against_the_full_cluster_s_speed_and_the_best_size_s() -> None:
    """Steps of 1 s on 2 processes and 1.5 s on 1: 1 node-second more per step on 2. 30 steps over 50 node-seconds:
    at the full cluster's 2 node-seconds a step, 60/50; at the best size's 1.5, 45/50."""
    ended = [(1, 0.0, 2), (2, 1.0, 2), (3, 2.0, 2), (4, 3.5, 1), (5, 5.0, 1), (7, 9.0, 1)]  # (7: a gap, not a step)
    by_size = step_seconds_by_size(ended)
    assert by_size == {2: pytest.approx(1.0), 1: pytest.approx(1.5)}
    got = figures(30, by_size, 2, 50.0)
    assert got["gpu_time_efficiency"] == pytest.approx(30 * 1.0 * 2 / 50)
    assert got["gpu_time_efficiency_strict"] == pytest.approx(30 * 1.5 * 1 / 50)
    assert figures(30, {1: 1.5}, 2, 50.0)["gpu_time_efficiency"] is None, "the full cluster never trained"
