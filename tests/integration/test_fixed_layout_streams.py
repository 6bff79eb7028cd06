"""Streams fed to a fixed layout, trained by real processes: each replica's own stream, resumed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.mark.slow
def test_a_chain_of_resumes_across_pipeline_depths_trains_like_one_process(tmp_path: Path) -> None:
    """P2xD2 -> P1xD2 -> P2xD2 on per-replica streams (5 global batches per pass), resumed mid-pass at step 3 from
    DCP shards, then at the end of the first pass (step 5) from snapshot files. The final weights equal one
    single-process run over the whole stream."""
    from tests.parity import assert_same_params, merged_state, reference_run, run_scenarios

    run, memory = str(tmp_path / "run"), str(tmp_path / "shm")
    common: dict[str, Any] = {"model": {"scheduler": True}, "loader": {"batch_size": 16, "n": 80, "stream": "fixed"}}

    def phase(name: str, stages: int, steps: int, spot: dict) -> dict[str, Any]:
        spot = {**spot, "dirpath": run, "every_n_train_steps": 1, "keep_last": 2}
        strategy = {"pipeline_stages": stages, "microbatches": 2}
        return {**common, "name": name, "strategy": strategy, "trainer": {"max_steps": steps}, "spot_checkpoint": spot}

    phases = [
        (4, phase("fixed-1", 2, 3, {"snapshots": False})),
        (2, phase("fixed-2", 1, 5, {"snapshot_dir": memory, "snapshot_every_n_train_steps": 1, "resume": True})),
        (4, phase("fixed-3", 2, 12, {"snapshot_dir": memory, "resume": True})),
    ]
    results: dict[str, list[dict]] = {}
    for i, (world, scenario) in enumerate(phases):
        results.update(run_scenarios(world, [scenario], tmp_path / f"phase{i}", timeout=300))
    assert {(r["restored_step"], r["restored_tier"]) for r in results["fixed-2"]} == {(3, "storage")}
    assert {(r["restored_step"], r["restored_kind"]) for r in results["fixed-3"]} == {(5, "shares")}
    # the reference: the whole stream's global batches, which the replicas' streams split between them
    whole = {"batch_size": 16, "n": 80, "stream": True}
    reference = reference_run({"model": {"scheduler": True}, "loader": whole, "trainer": {"max_steps": 12}})
    assert_same_params(merged_state(results["fixed-3"]), reference)
