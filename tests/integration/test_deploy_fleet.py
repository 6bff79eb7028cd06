"""The deployment recipes run as a local fleet (``tests/deploy_fleet.py``): a notice, a lost node and both
returns cost the other pipeline about a second; the pipelines end equal to one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.deploy_fleet import run_fleet
from tests.integration.test_fault_tolerance import _reference, _results, needs_hostname
from tests.parity import assert_same_params


@pytest.mark.slow
@needs_hostname
@pytest.mark.timeout(420)
def test_a_fleet_of_recipes_rides_through_a_notice_a_lost_node_and_both_returns(tmp_path: Path) -> None:
    """Pipeline 0 as the Slurm batch script, pipeline 1 as the SkyPilot job's ``run``, on one coordinator: a notice
    to pipeline 1 (exit 75, relaunched), then pipeline 0's node killed (requeued). Both equal one process; the other
    pipeline's longest pause is printed (``benchmarks/deploy_fleet.py`` repeats it)."""
    figures = run_fleet(tmp_path)
    results = _results(tmp_path / "out")
    for group in (0, 1):
        done = results[f"group{group}_rank0"]["global_step"]
        assert_same_params(results[f"group{group}_rank0"]["state_dict"], _reference(done))
    print("\nfleet: " + ", ".join(f"{k} {v:.1f}" for k, v in figures.items()))
    assert figures["pause_during_notice_seconds"] < 10 and figures["pause_after_kill_seconds"] < 10, figures


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_elastic_pytorchjob_recipe_restarts_on_the_pod_left_from_memory(tmp_path: Path) -> None:
    """The restart path under the Kubernetes recipe (its PyTorchJob pod's flags and environment): a pod killed, the
    other restarts the job on itself from its memory (the time lost is printed); the run equals one process. (A
    pod made again joins and the job grows back in `benchmarks/deploy_fleet.py --restart-path`; a node that joins an
    elastic job is tested in test_preemption.py.)"""
    from tests.deploy_fleet import run_restart_fleet
    from tests.parity import merged_state, reference_run

    steps = 24
    figures = run_restart_fleet(tmp_path, steps, regrow=False)
    finals = [torch.load(path) for path in sorted((tmp_path / "out" / "final").glob("rank*.pt"))]
    case = {"model": {"scheduler": True}, "loader": {"batch_size": 16, "n": 80, "shuffle": True}}
    assert_same_params(merged_state(finals), reference_run({**case, "trainer": {"max_steps": steps}}))
    print("\nrestart fleet: " + ", ".join(f"{k} {v:.1f}" for k, v in figures.items()))
    assert figures["restarts"] >= 1 and figures["restart_time_lost_seconds"] < 30, figures
