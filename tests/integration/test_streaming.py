"""Streams trained by real processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.parity import assert_same_params, merged_state, reference_run, run_scenarios

COMMON: dict[str, Any] = {"model": {"scheduler": True}, "loader": {"batch_size": 16, "n": 80, "stream": True}}


def _phase(name: str, strategy: dict, steps: int, spot: dict) -> dict[str, Any]:
    return {**COMMON, "name": name, "strategy": strategy, "trainer": {"max_steps": steps}, "spot_checkpoint": spot}


@pytest.mark.slow
def test_a_chain_of_resumes_across_layouts_trains_the_same_samples(tmp_path: Path) -> None:
    """P2xD2 -> P1xD1 -> P2xD1 on a stream of 5 global batches per pass, resumed mid-pass at steps 3 and 7: from a
    durable checkpoint of DCP shards, then from one made of snapshot files. The final weights equal one
    uninterrupted single-process run over the same stream. (From memory: tests/integration/test_snapshots.py.)"""
    run = str(tmp_path / "run")
    memory = str(tmp_path / "shm")
    phases = [
        (4, _phase("stream-1", {"pipeline_stages": 2, "microbatches": 2}, 3, {"snapshots": False})),
        (1, _phase("stream-2", {"pipeline_stages": 1, "microbatches": 2}, 7, {"snapshot_dir": memory})),
        (2, _phase("stream-3", {"pipeline_stages": 2, "microbatches": 2}, 12, {"snapshot_dir": memory})),
    ]
    results: dict[str, list[dict]] = {}
    for i, (world, phase) in enumerate(phases):
        phase["spot_checkpoint"].update(dirpath=run, every_n_train_steps=1, keep_last=2, resume=i > 0)
        if i:
            phase["spot_checkpoint"]["snapshot_every_n_train_steps"] = 1
        results.update(run_scenarios(world, [phase], tmp_path / f"phase{i}", timeout=300))
    assert [(r["restored_step"], r["restored_tier"]) for r in results["stream-2"]] == [(3, "storage")]
    reads = {(r["stage_rank"], r["samples_read"] > 0) for r in results["stream-1"] + results["stream-3"]}
    assert reads == {(0, True), (1, False)}, "only first stages read the stream; the others receive its batches"
    assert {(r["restored_step"], r["restored_tier"]) for r in results["stream-3"]} == {(7, "storage")}
    assert {r["restored_kind"] for r in results["stream-3"]} == {"shares"}, "a checkpoint of snapshot files"
    assert results["stream-2"][0]["restored_kind"] != "shares", "phase 1 wrote DCP shards"
    reference = reference_run({**COMMON, "trainer": {"max_steps": 12}})
    assert_same_params(merged_state(results["stream-3"]), reference)


def test_resumes_at_the_ends_of_passes_keep_the_order(tmp_path: Path) -> None:
    """Checkpoints after a pass's last batch (5 global batches per pass), resumed twice in a row."""
    spot = {"dirpath": str(tmp_path / "run"), "every_n_train_steps": 5, "keep_last": 2}
    phases = [_phase(f"ends-{s}", {"pipeline_stages": 1}, s, {**spot, "resume": s > 5}) for s in (5, 10, 15)]
    results = run_scenarios(1, phases, tmp_path / "job", timeout=300)
    assert [r["restored_step"] for r in (results["ends-10"][0], results["ends-15"][0])] == [5, 10]
    assert_same_params(merged_state(results["ends-15"]), reference_run({**COMMON, "trainer": {"max_steps": 15}}))
    epochs = [
        json.loads((tmp_path / "run" / f"step-0000000{s}" / "manifest.json").read_text())["epoch"] for s in (10, 15)
    ]
    assert epochs == [1, 2], "Lightning's epoch count as in an uninterrupted run (an empty epoch would add one)"
