"""A synthetic spot trace replayed end to end (``benchmarks/spot_replay.py``): real torchrun agents of one CPU
process join and leave; the figures must agree with the replay's own event log, the parameters with an
uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.spot_replay import figures, parse_events, replay


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_synthetic_trace_replays_with_the_same_math(tmp_path: Path) -> None:
    # two nodes; one leaves with a notice, one joins, one is killed; each event waits until the group trains
    # again after the previous one (a 1 s rendezvous keep-alive: nodes that left are given up after ~3 s)
    events = parse_events("0:+2,1:-1s,2:+1,3:-1k")
    result = replay(events, steps=60, step_seconds=0.25, out=tmp_path, settle=True, keep_alive=1)
    assert result["ok"]
    log = result["events"]
    assert [(e["event"], e.get("notice")) for e in log] == [
        ("join", None),
        ("join", None),
        ("leave", True),
        ("join", None),
        ("leave", False),
    ]
    fig = figures(tmp_path, result)
    report = fig["report"]
    assert fig["max_param_difference"] <= 1e-5, "the same math as an uninterrupted single-process run"

    # one restart per event after the start, caused by that event, in order
    assert [p["event"] for p in fig["phases"]] == ["leave (notice)", "join", "leave (kill)"]
    assert [r["cause"] for r in report["restarts"]] == [
        "preemption notice (SIGTERM)",  # the leaving node's notice
        "preemption notice (SIGTERM)",  # torchrun stops the workers to let the new node in
        "failure (no notice)",
    ]
    worlds = [a["layout_detail"]["world_size"] for a in report["attempts"]]
    assert worlds == [e["nodes"] for e in log[1:]], "each attempt ran on the nodes the log says were there"
    assert fig["steps_recomputed"] <= 1, "snapshots every step: a kill loses at most the step under way"
    assert report["attempts"][-1]["last_step"] == 60

    # the phases: measured, and adding up to what each restart lost
    for p in fig["phases"]:
        phases = p["phases"]
        assert (phases["stop"] is not None) == (p["event"] != "leave (kill)"), p
        timed = [phases[k] for k in ("restart", "setup", "restore", "first_step")]
        assert all(t is not None and t >= 0 for t in timed), p
        assert sum(timed) == pytest.approx(p["time_lost"], abs=0.01)
        assert p["event_to_first_step"] > phases["setup"] > 0
    kill = fig["phases"][-1]
    assert 0 < kill["after_kill"] <= kill["phases"]["restart"] + 0.05, "the kill falls after the last record"

    # the useful-time share: time on kept steps over wall time, less than wall minus time lost
    share = fig["useful_time_share"]
    assert 0 < share < 1 - fig["time_lost_seconds"] / fig["wall_seconds"] + 0.02
