"""Faults in sequence (issue 71): three pipelines of two nodes on one coordinator, hit one after another."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos import ChaosSoak
from tests.integration.test_fault_tolerance import needs_hostname


@pytest.mark.slow
@needs_hostname
@pytest.mark.timeout(480)
def test_faults_in_sequence_never_stop_an_untouched_pipeline_nor_start_the_run_over(tmp_path: Path) -> None:
    """Each defect of issue 71 in turn, on one fleet (``tests/chaos.py``; the seeded soak is
    ``benchmarks/chaos_soak.py``): node 1b is killed (with three pipelines, its survivor's join at depth 1 held
    the others for 35 s and every pipeline started over); while pipeline 1 is broken, node 2b gets a notice (its
    first rank kept heartbeating, so the others waited the lighthouse's 5 s join timeout); the coordinator is
    restarted twice, down 2 s each, 10 s apart (the second restart's quorum kept the first's id: one pipeline
    trained alone and another restarted); then the two nodes come back on the new store, one after the other. The
    step history of every process must show no start-over, each event's untouched pipelines a pause within the goal
    (2 s for a node, 5 s for a coordinator restart, its downtime included) and no restart, and every pipeline must
    end equal to one process (SGD)."""
    script = [("kill", "1b", 12.0), ("notice", "2b", 10.0), ("coordinator", "2", 10.0), ("coordinator", "2", 12.0)]
    script += [("return", "1b", 10.0), ("return", "2b", 8.0)]
    report = ChaosSoak(tmp_path, seed=0, script=script).run()
    print("\n" + "\n".join(report.rows()))
    assert report.failures() == [], "\n".join(report.failures())
    kill, notice, first, second, back_1, back_2 = report.events
    assert set(kill.pauses) == {"0", "2"} and set(notice.pauses) == {"0"}, "the untouched pipelines were measured"
    assert set(first.pauses) == set(second.pauses) == {"0"} and second.downtime > 0.5
    assert set(back_1.pauses) == {"0"} and set(back_2.pauses) == {"0", "1"}
    assert min(report.steps.values()) > 100, report.steps
    assert all(d <= 1e-5 for d in report.weights.values()), report.weights
    assert "3 live: pipeline 0" in (tmp_path / "coordinator.log").read_text(), "the coordinator logs membership"
