"""LitData streams trained by real processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.litdata_data import Job, write_litdata


@pytest.mark.slow
def test_a_chain_of_resumes_across_layouts_and_workers_trains_like_one_process(tmp_path: Path) -> None:
    """P1xD1 -> P2xD2 -> P2xD1 with 2 DataLoader workers (5 global batches per pass), resumed mid-pass at step 3
    from DCP shards, then at the end of the first pass (step 5) from snapshot files. The final weights equal one
    uninterrupted single-process run over the same LitData stream."""
    from tests.parity import assert_same_params, merged_state, reference_run, run_scenarios

    data = write_litdata(tmp_path / "data", 80)
    common: dict[str, Any] = {"model": {"scheduler": True}, "loader": {"batch_size": 16, "litdata": data}}
    run, memory = str(tmp_path / "run"), str(tmp_path / "shm")

    def phase(name: str, stages: int, steps: int, spot: dict, workers: int = 0) -> dict[str, Any]:
        return {
            **common,
            "loader": {**common["loader"], "num_workers": workers},
            "name": name,
            "strategy": {"pipeline_stages": stages, "microbatches": 2},
            "trainer": {"max_steps": steps},
            "spot_checkpoint": {**spot, "dirpath": run, "every_n_train_steps": 1, "keep_last": 2},
        }

    phases = [
        (1, phase("litdata-1", 1, 3, {"snapshots": False})),
        (4, phase("litdata-2", 2, 5, {"snapshot_dir": memory, "snapshot_every_n_train_steps": 1, "resume": True})),
        (2, phase("litdata-3", 2, 12, {"snapshot_dir": memory, "resume": True}, workers=2)),
    ]
    results: dict[str, list[dict]] = {}
    for i, (world, scenario) in enumerate(phases):
        results.update(run_scenarios(world, [scenario], tmp_path / f"phase{i}", timeout=300))
    assert [(r["restored_step"], r["restored_tier"]) for r in results["litdata-2"]] == [(3, "storage")] * 4
    assert {(r["restored_step"], r["restored_kind"]) for r in results["litdata-3"]} == {(5, "shares")}
    reference = reference_run({**common, "trainer": {"max_steps": 12}})
    assert_same_params(merged_state(results["litdata-3"]), reference)


@pytest.mark.slow
def test_the_survivors_of_a_lost_node_resume_litdata_from_memory(tmp_path: Path) -> None:
    """Two nodes train P2xD2 on LitData's stream with snapshots every 2 steps; one node is SIGKILLed; the
    survivors resume from memory on P2xD1 (D 2 -> 1) and train the global batches of the uninterrupted P2xD2 run."""
    from tests.integration.test_snapshots import STEPS, _two_nodes_lose_one
    from tests.parity import assert_same_params, merged_state, reference_run

    data = write_litdata(tmp_path / "data", 80)
    finals = _two_nodes_lose_one(
        tmp_path, run=str(tmp_path / "run"), loader={"batch_size": 16, "litdata": data, "shuffle": True}
    )
    d2 = Job(data, 2, n=80, batch=16)  # the passes of P2xD2 uninterrupted, each batch in its replicas' row order
    passes = [[i for _ in range(5) for i in d2.step(ordered=True)] for _ in range(-(-STEPS // 5))]
    whole = {"batch_size": 16, "n": 80, "passes": passes}
    reference = reference_run({"model": {"scheduler": True}, "loader": whole, "trainer": {"max_steps": STEPS}})
    assert_same_params(merged_state(finals), reference)
