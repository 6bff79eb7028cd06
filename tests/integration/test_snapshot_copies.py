"""Snapshot copies in real multi-process runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def test_a_dropped_snapshot_still_takes_part_in_the_peer_copies(tmp_path: Path) -> None:
    """Peer copies go both ways between nodes: a rank whose share was dropped still sends (a marker) and
    receives, so that its peers do not wait for it; nobody keeps a copy of the dropped share."""
    import json

    from tests.distributed import launch

    launch(2, ["tests/workers/snapshot_peers.py", str(tmp_path)], log_dir=tmp_path / "logs", timeout=120)
    held = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert held[0]["changed"] and not held[1]["changed"]
    # each node: rank 0's newest two shares (steps 1 and 3: there is no step 2) and rank 1's (2 and 3)
    assert held[0]["shares"] == held[1]["shares"] == {"1": [0], "2": [1], "3": [0, 1]}


def test_the_next_optimizer_step_waits_for_the_background_copies(tmp_path: Path) -> None:
    """P2xD1 with a snapshot every step whose background copies start 0.3 s late (steps take milliseconds): the
    optimizer steps wait for them (SpotCheckpoint.on_before_optimizer_step), so no snapshot sees a later value
    and none is dropped; training is that of plain single-process Lightning."""
    from tests.parity import assert_same_params, merged_state, reference_run, run_scenarios

    case: dict[str, Any] = {
        "name": "slow-copies",
        "strategy": {"pipeline_stages": 2, "microbatches": 2},
        "trainer": {"max_steps": 5},
        "slow_snapshot_copies": 0.3,
        "spot_checkpoint": {
            "dirpath": str(tmp_path / "run"),
            "every_n_train_steps": 1000,
            "snapshot_every_n_train_steps": 1,
            "snapshot_dir": str(tmp_path / "shm"),
        },
    }
    ranks = run_scenarios(2, [case], tmp_path / "job", timeout=300)["slow-copies"]
    for r in ranks:
        assert [(t["step"], t["mapped"], "changed" in t) for t in r["spot"]["snapshots"]] == [
            (1, False, False),
            *((step, True, False) for step in range(2, 6)),
        ]
    assert_same_params(merged_state(ranks), reference_run(case))
