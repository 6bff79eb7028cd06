"""A synthetic spot trace replayed end to end (``benchmarks/spot_replay.py``): real torchrun agents of one CPU
process join and leave (a cloud notice through a stand-in metadata service, a kill); the figures must agree
with the replay's own event log, the parameters with an uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.spot_replay import figures, parse_events, replay
from tests.elastic import assert_restart_phases


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_synthetic_trace_replays_with_the_same_math(tmp_path: Path) -> None:
    # two nodes; one leaves after its cloud's notice (its metadata service announces the spot interruption; the
    # machine is taken 8 s later: time enough to rejoin if it did not leave), one joins, one is killed; each event waits until the group trains again after
    # the previous one (lightning-spot run's rendezvous defaults: nodes that died are given up after ~3 s)
    events = parse_events("0:+2,1:-1m,2:+1,3:-1k")
    result = replay(events, steps=60, step_seconds=0.25, out=tmp_path, settle=True, lead_seconds=8)
    assert result["ok"]
    log = result["events"]
    assert [(e["event"], e.get("source")) for e in log if e["event"] != "reclaimed"] == [
        ("join", None),
        ("join", None),
        ("leave", "metadata"),
        ("join", None),
        ("leave", None),
    ]
    reclaimed = [e for e in log if e["event"] == "reclaimed"]
    assert [e["node"] for e in reclaimed] == ["node-2"], "taken at the end of its notice"
    assert not reclaimed[0]["running"], "the node under notice left the job by itself (else it rejoins until taken)"
    fig = figures(tmp_path, result)
    report = fig["report"]
    assert fig["max_param_difference"] <= 1e-5, "the same math as an uninterrupted single-process run"

    # one restart per event after the start, caused by that event, in order (on a busy machine the second node
    # can miss the first rendezvous round: then one more restart takes it in first)
    worlds = [a["layout_detail"]["world_size"] for a in report["attempts"]]
    late = 1 if worlds[0] == 1 else 0
    assert [p["event"] for p in fig["phases"]] == ["join"] * late + ["leave (notice)", "join", "leave (kill)"]
    assert [r["cause"] for r in report["restarts"]][late:] == [
        "preemption notice (aws)",  # the node under notice stopped everyone, then left: no second restart
        "preemption notice (SIGTERM)",  # torchrun stops the workers to let the new node in
        "failure (no notice)",
    ]
    nodes = [e["nodes"] for e in log[1:] if e["event"] != "reclaimed"]
    assert worlds[late:] == nodes, "each attempt ran on the nodes the log says were there"
    assert fig["steps_recomputed"] <= 1, "snapshots every step: a kill loses at most the step under way"
    assert report["attempts"][-1]["last_step"] == 60

    # the phases: measured, and adding up to what each restart lost
    for restart, p in zip(report["restarts"], fig["phases"]):
        assert_restart_phases(restart, notice=p["event"] != "leave (kill)")
        assert p["phases"] == restart["phases"] and p["time_lost"] == restart["time_lost_seconds"]
        assert p["event_to_first_step"] > p["phases"]["setup"] > 0
    kill = fig["phases"][-1]
    assert 0 < kill["after_kill"] <= kill["phases"]["restart"] + 0.05, "the kill falls after the last record"

    # the useful-time share: time on kept steps over wall time, less than wall minus time lost (kept steps are
    # timed at their attempt's mean pace, an estimate: attempts of a few seconds each here, hence the slack)
    share = fig["useful_time_share"]
    assert 0 < share < 1 - fig["time_lost_seconds"] / fig["wall_seconds"] + 0.05
