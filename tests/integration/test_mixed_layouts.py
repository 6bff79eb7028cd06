"""Checkpoints move between uniform layouts and pipelines of mixed depths with the same training math.

One run, four jobs in a row on one run directory, each resuming the previous one's last checkpoint:
P2xD2 (4 processes, 3 steps) -> [1, 2] (a one-GPU node lost: 3 processes, to step 7) -> [2, 3] (two GPUs
joined: 5 processes, to step 10) -> P2xD1 (2 processes, to step 12). The end state must equal 12
uninterrupted single-process steps (Adam, StepLR, shuffled data, mid-epoch stops). The P2xD2 and [1, 2] jobs
also take in-memory snapshots, so the checkpoints they write are of kind "shares" (their snapshots' files); the
[2, 3] job writes DCP shards. Both kinds are read back onto another layout. The P2xD2 job streams its weights
from host memory (``offload="parameters"``: snapshots and checkpoints read the host masters), the [1, 2] job
keeps its optimizer state there (``offload="optimizer"``) and resumes from the streamed job's checkpoint, and the
next job, without offload, from its checkpoint.

Under torchrun, a node joining two others with everything "auto" makes the planner pick a mix, so that all three
processes train (the restart resumes from the first nodes' in-memory snapshots).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_spot.checkpoint.durable.storage import Storage
from tests.distributed import free_port
from tests.elastic import Agent, agents_cleanup, wait_for
from tests.parity import assert_same_params, merged_state, reference_run, run_scenarios

COMMON: dict[str, Any] = {"model": {"scheduler": True}, "loader": {"batch_size": 16, "n": 80, "shuffle": True}}
TOTAL_STEPS = 12
# (world, strategy, last step, snapshots)
CHAIN: list[tuple[int, dict[str, Any], int, bool]] = [
    (4, {"pipeline_stages": 2, "microbatches": 2, "offload": "parameters"}, 3, True),
    (3, {"pipeline_stages": [1, 2], "offload": "optimizer"}, 7, True),
    (5, {"pipeline_stages": [2, 3], "microbatches": [3, 5]}, 10, False),
    (2, {"pipeline_stages": 2, "microbatches": 4}, TOTAL_STEPS, False),
]


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("mixed")
    run = str(tmp / "run")
    results, manifests = [], []
    for i, (world, strategy, steps, snapshots) in enumerate(CHAIN):
        spot: dict[str, Any] = {"dirpath": run, "every_n_train_steps": 2, "keep_last": 2, "resume": True}
        spot["snapshots"] = bool(snapshots)
        if snapshots:
            spot.update(snapshot_every_n_train_steps=1, snapshot_dir=str(tmp / "shm" / str(i)))
        phase = {
            **COMMON,
            "name": f"phase{i}",
            "strategy": strategy,
            "trainer": {"max_steps": steps},
            "spot_checkpoint": spot,
        }
        results.append(run_scenarios(world, [phase], tmp / f"phase{i}", timeout=300)[f"phase{i}"])
        manifests.append(Storage(run).read_json(f"step-{steps:09d}/manifest.json"))
    return {"results": results, "manifests": manifests}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_uniform_to_mixed_to_mixed_to_uniform_has_the_same_math(chain: dict[str, Any]) -> None:
    ref = reference_run({**COMMON, "trainer": {"max_steps": TOTAL_STEPS}})
    for i, ranks in enumerate(chain["results"][1:], start=1):
        resumed_from = CHAIN[i - 1][2]
        assert all(r["restored_step"] == resumed_from for r in ranks), (i, [r.get("restored_step") for r in ranks])
    last = chain["results"][-1]
    assert_same_params(merged_state(last), ref)
    for r in last:
        assert r["metrics"]["train_loss"] == pytest.approx(ref["metrics"]["train_loss"], abs=1e-5)


@pytest.mark.slow
def test_every_rank_of_a_mixed_layout_trains_its_share(chain: dict[str, Any]) -> None:
    """[1, 2] and [2, 3]: every process holds parameters and runs micro-batches; layouts recorded in manifests."""
    for i in (1, 2):
        world, strategy, _, _ = CHAIN[i]
        ranks = chain["results"][i]
        assert len(ranks) == world and all(r["state_dict"] and r["microbatches"] >= 1 for r in ranks)
        layout = chain["manifests"][i]["layout"]
        assert [p["depth"] for p in layout["pipelines"]] == strategy["pipeline_stages"]
        assert sum(p["microbatches"] for p in layout["pipelines"]) == layout["microbatches"]
        assert layout["world_size"] == world
    assert chain["manifests"][1]["kind"] == "shares"  # the [1, 2] job's snapshots, uploaded as they are
    assert sorted(chain["manifests"][1]["shares"]) == ["0", "1", "2"]
    assert "kind" not in chain["manifests"][2]  # DCP shards
    assert [p["microbatches"] for p in chain["manifests"][2]["layout"]["pipelines"]] == [3, 5]


@pytest.mark.slow
def test_a_streamed_job_snapshots_its_host_masters_and_another_layout_resumes_from_them(chain: dict[str, Any]) -> None:
    """P2xD2 with offload="parameters": between steps its weights rested in host memory; its snapshots, uploaded as
    the checkpoint the [1, 2] job resumed from (restored_step and the end state: the test above), read them there."""
    first = chain["results"][0]
    for r in first:
        assert r["offload_levels"] == ["optimizer", "parameters"], r["offload_levels"]
        assert r["weights"]["checks"] > 0 and not r["weights"]["not_resident"] and r["weights"]["at_rest_on_host"]
    assert chain["manifests"][0]["kind"] == "shares"


def test_a_mixed_layout_restores_its_own_random_state(tmp_path: Path) -> None:
    """Manifests of mixed layouts read back to the same layout (so a restart on it restores RNG states)."""
    from lightning_spot.layout import Layout, PipelineLayout

    layout = PipelineLayout.mixed(Layout.of_depths([2, 3]), "1F1B", [[2], [1, 3]], [3, 5])
    assert PipelineLayout.from_dict(layout.to_dict()) == layout
    assert str(layout) == "P2+P3 1F1B M=3+5"
    assert PipelineLayout.from_dict(layout.to_dict()) != PipelineLayout.mixed(
        Layout.of_depths([2, 3]), "1F1B", [[2], [1, 3]], [4, 4]
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_elastic_restart_onto_an_odd_world_trains_every_process(tmp_path: Path) -> None:
    """torchrun: two one-process nodes train with everything "auto"; a third node joins. The model has two layers
    and the global batch is 16, so no uniform layout of 3 fits (P3 needs 3 layers, D3 does not divide 16): the
    planner picks pipelines of mixed depths, every process trains, the joining node's rank gets its tensors from
    the others' snapshots, and the run ends equal to an uninterrupted one."""
    steps = 30
    case = {"model": {"num_layers": 2, "scheduler": True}, "loader": {"batch_size": 16, "n": 80, "shuffle": True}}
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                **case,
                "out": str(tmp_path / "out"),
                "run": str(tmp_path / "run"),
                "max_steps": steps,
                "step_seconds": 0.25,
                "every": 1000,  # durable only at the end: the restart resumes from memory
                "snapshot_every": 2,
                "strategy": {"profile_cache": None},
            }
        )
    )
    shm = {name: tmp_path / f"shm-{name}" for name in "abc"}
    port = free_port()
    args = ["tests/workers/elastic_train.py", str(config)]
    with agents_cleanup([]) as agents:
        for name in "abc":
            env = {"SPOT_TEST_SNAPSHOT_DIR": str(shm[name])}
            agents.append(Agent(f"node-{name}", port, 1, args, tmp_path / f"{name}.log", nnodes="2:3", env=env))
            if name == "b":
                wait_for(lambda: any(shm["a"].glob("*/step-000000004/rank*.json")), 240, "a snapshot", agents)
        wait_for(lambda: all(a.proc.poll() is not None for a in agents), 400, "the nodes to finish", agents)
        for agent in agents:
            assert agent.proc.returncode == 0, agent.output()[-5000:]
    finals = [torch.load(tmp_path / "out" / "final" / f"rank{r}.pt") for r in range(3)]
    assert {f["layout"] for f in finals} == {"P1+P2"}, [f["layout"] for f in finals]
    assert all(4 <= f["restored_step"] < steps for f in finals), "the group grew in the middle of training"
    assert all(f["restored_tier"] == "memory" for f in finals), [f["restored_tier"] for f in finals]
    assert_same_params(merged_state(finals), reference_run({**case, "trainer": {"max_steps": steps}}))
