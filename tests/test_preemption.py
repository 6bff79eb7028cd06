"""Preemption on real torchrun agents: a coordinated stop, then an elastic restart on fewer or more workers.

Two torchrun agents on loopback play two nodes with 2 workers each. The run checkpoints with
SpotCheckpoint; a node leaves (SIGTERM to its agent, as a spot VM's shutdown does) or joins, the
group restarts with a new world size, picks a new layout and resumes; the final weights equal an
uninterrupted single-process run.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed import free_port
from tests.elastic import Agent, agents_cleanup, port_open, wait_for
from tests.parity import assert_same_params, merged_state, reference_run

STEPS = 16
CASE: dict[str, Any] = {"model": {"scheduler": True}, "loader": {"batch_size": 16, "n": 80, "shuffle": True}}


def _config(tmp: Path, **extra: Any) -> Path:
    config = {
        "out": str(tmp / "out"),
        "run": str(tmp / "run"),
        "max_steps": STEPS,
        "step_seconds": 0.25,
        "strategy": {"pipeline_stages": "auto", "microbatches": "auto"},
        **extra,
    }
    path = tmp / "config.json"
    path.write_text(json.dumps(config))
    return path


def _committed(tmp: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in (tmp / "run").glob("step-*/manifest.json"))


def _finals(tmp: Path, world: int) -> list[dict]:
    return [torch.load(tmp / "out" / "final" / f"rank{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def uninterrupted() -> dict[str, Any]:
    return reference_run({**CASE, "trainer": {"max_steps": STEPS}})


def test_node_leaves_after_sigterm_and_the_survivor_finishes(tmp_path: Path, uninterrupted: dict) -> None:
    config = _config(tmp_path)
    port = free_port()
    args = ["tests/workers/elastic_train.py", str(config)]
    with agents_cleanup([]) as agents:
        agents.append(Agent("node-a", port, 2, args, tmp_path / "a.log"))
        wait_for(lambda: port_open(port), 60, "node a to host the rendezvous", agents)  # the host must survive
        agents.append(Agent("node-b", port, 2, args, tmp_path / "b.log"))
        wait_for(lambda: any(s >= 4 for s in _committed(tmp_path)), 240, "a checkpoint at step 4", agents)
        agents[1].signal(signal.SIGTERM)  # node b is being preempted; its agent forwards SIGTERM to its workers
        wait_for(lambda: agents[0].proc.poll() is not None, 300, "the survivor to finish", agents[:1])
        assert agents[0].proc.returncode == 0, agents[0].output()[-5000:]
        out_b = agents[1].output()
    finals = _finals(tmp_path, 2)
    assert {f["layout"] for f in finals} == {"P2xD1"} and {f["num_nodes"] for f in finals} == {1}
    assert_same_params(merged_state(finals), uninterrupted)
    report = finals[0]["report"]
    assert report["preemptions_survived"] == 1
    restart = report["restarts"][0]
    assert restart["cause"] == "preemption notice (SIGTERM)"
    assert restart["steps_recomputed"] == 0, "the coordinated stop checkpointed the step it stopped at"
    assert restart["layout_before"]["world_size"] == 4 and restart["layout_after"]["world_size"] == 2
    assert "preemption notice on rank" in (agents[0].output() + out_b)


def test_node_joins_and_the_job_grows(tmp_path: Path, uninterrupted: dict) -> None:
    config = _config(tmp_path)
    port = free_port()
    args = ["tests/workers/elastic_train.py", str(config)]
    with agents_cleanup([]) as agents:
        agents.append(Agent("node-a", port, 2, args, tmp_path / "a.log"))
        wait_for(lambda: any(s >= 4 for s in _committed(tmp_path)), 240, "a checkpoint at step 4 on one node", agents)
        agents.append(Agent("node-b", port, 2, args, tmp_path / "b.log"))
        wait_for(lambda: all(a.proc.poll() is not None for a in agents), 300, "both nodes to finish", agents)
        for agent in agents:
            assert agent.proc.returncode == 0, agent.output()[-5000:]
    finals = _finals(tmp_path, 4)
    assert {f["layout"] for f in finals} == {"P4xD1"} and {f["num_nodes"] for f in finals} == {2}
    assert_same_params(merged_state(finals), uninterrupted)
    report = finals[0]["report"]
    assert report["preemptions_survived"] == 1
    assert report["restarts"][0]["layout_before"]["world_size"] == 2
    assert report["restarts"][0]["layout_after"]["world_size"] == 4
