"""In-memory snapshots across real processes and torchrun agents: peers, survivors, a node that joins."""

from __future__ import annotations

import json
import math
import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_spot.checkpoint.durable.journal import read_events
from lightning_spot.checkpoint.durable.storage import Storage
from tests.distributed import free_port
from tests.elastic import Agent, agents_cleanup, assert_restart_phases, port_open, wait_for
from tests.parity import assert_same_params, merged_state, reference_run

STEPS = 16


CASE: dict[str, Any] = {"model": {"scheduler": True}, "loader": {"batch_size": 16, "n": 80, "shuffle": True}}


@pytest.fixture(scope="module")
def uninterrupted() -> dict[str, Any]:
    return reference_run({**CASE, "trainer": {"max_steps": STEPS}})


def _config(tmp_path: Path, **overrides: Any) -> Path:
    """The config of ``tests/workers/elastic_train.py``: P2 with 2 micro-batches, snapshots every 2 steps,
    nothing durable until the end, slowed steps so that a test can act in the middle of the run."""
    config = {
        "out": str(tmp_path / "out"),
        "run": str(tmp_path / "run"),
        "max_steps": STEPS,
        "step_seconds": 0.25,
        "every": 1000,  # durable only at the end
        "snapshot_every": 2,
        "strategy": {"pipeline_stages": 2, "microbatches": 2},
        **overrides,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.slow
def test_killed_worker_resumes_from_host_memory_with_the_defaults(
    tmp_path: Path, uninterrupted: dict[str, Any]
) -> None:
    """``SpotCheckpoint(dirpath=...)`` with nothing else: snapshots at a chosen interval; one worker is SIGKILLed
    under torchrun; the restarted workers read memory, at most one snapshot interval back, and the run's durable
    checkpoints are made of snapshot files."""
    snapshots = tmp_path / "shm"
    step_seconds = 0.4
    config = _config(
        tmp_path,
        snapshot_dir=str(snapshots),
        every=None,
        snapshot_every=None,
        snapshots=True,
        step_seconds=step_seconds,
    )
    run = Storage(str(tmp_path / "run"))

    def committed() -> list[int]:
        return sorted({int(p.parent.name.split("-")[1]) for p in snapshots.glob("*/step-*/rank*.json")})

    def cadence() -> list[dict[str, Any]]:
        return [e for e in read_events(run) if e["kind"] == "cadence"]

    port = free_port()
    with agents_cleanup([]) as agents:
        agents.append(
            Agent("node", port, 2, ["tests/workers/elastic_train.py", str(config)], tmp_path / "a.log", nnodes="1")
        )
        wait_for(lambda: any(s >= 6 for s in committed()) and cadence(), 240, "a snapshot at step 6", agents)
        chosen = cadence()[-1]
        victim = int((tmp_path / "out" / "pids" / "rank1-attempt0.pid").read_text())
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: agents[0].proc.poll() is not None, 300, "the restarted job to finish", agents)
        assert agents[0].proc.returncode == 0, agents[0].output()[-5000:]
    assert "SpotCheckpoint: snapshots every" in agents[0].output(), "the chosen intervals are said"
    assert chosen["snapshot_seconds"] >= 1.0 and chosen["durable_seconds"] > chosen["snapshot_seconds"], chosen
    finals = [torch.load(tmp_path / "out" / "final" / f"rank{r}.pt") for r in range(2)]
    assert all(f["restored_tier"] == "memory" for f in finals)
    assert_same_params(merged_state(finals), uninterrupted)
    assert not committed(), "snapshots are deleted when training ends"
    restart = finals[0]["report"]["restarts"][0]
    assert restart["resumed_from"] == "memory"
    interval_steps = math.ceil(max(e["snapshot_seconds"] for e in cadence()) / step_seconds)
    assert restart["steps_recomputed"] <= interval_steps + 1, (restart, interval_steps)
    last = run.committed()[-1]
    assert run.read_json(f"{last}/manifest.json")["kind"] == "shares", "durable checkpoints made from snapshots"


def _two_nodes_lose_one(
    tmp_path: Path, *, run: str, gate: Path | None = None, **overrides: Any
) -> list[dict[str, Any]]:
    """Two agents of 2 workers train P2xD2 with snapshots every 2 steps and nothing durable; node b is
    SIGKILLed (agent and workers) after step 6. With ``gate``, storage is unreachable from the kill until
    the survivors have resumed. Returns the survivors' final records."""
    config = _config(tmp_path, run=run, step_seconds=0.5, **overrides)
    shm = {name: tmp_path / f"shm-{name}" for name in ("a", "b")}

    def snapshot_steps(node: str) -> set[int]:
        return {int(p.parent.name.split("-")[1]) for p in shm[node].glob("*/step-*/rank*.json")}

    port = free_port()
    args = ["tests/workers/elastic_train.py", str(config)]
    env = {"SPOT_TEST_GATE": str(gate)} if gate else {}
    with agents_cleanup([]) as agents:
        for name in ("a", "b"):
            node_env = {**env, "SPOT_TEST_SNAPSHOT_DIR": str(shm[name])}
            agents.append(Agent(f"node-{name}", port, 2, args, tmp_path / f"{name}.log", env=node_env))
            if name == "a":
                wait_for(lambda: port_open(port), 60, "node a to host the rendezvous", agents)
        wait_for(lambda: any(s >= 6 for s in snapshot_steps("a")), 240, "snapshots of step 6", agents)
        held = {int(p.stem[4:]) for p in shm["a"].glob("*/step-000000004/rank*.json")}
        assert held == {0, 1, 2, 3}, f"node a keeps its own shares and node b's copies of step 4, got ranks {held}"
        if gate:
            gate.write_text("closed")
        agents[1].kill_node()  # the whole node: agent and workers, no notice
        if gate:
            wait_for(lambda: "in-memory snapshot" in agents[0].output(), 240, "a resume from memory", agents[:1])
            gate.unlink()
        wait_for(lambda: agents[0].proc.poll() is not None, 300, "the survivor to finish", agents[:1])
        assert agents[0].proc.returncode == 0, agents[0].output()[-5000:]
        assert not snapshot_steps("a"), "snapshots are deleted when training ends"
    finals = [torch.load(tmp_path / "out" / "final" / f"rank{r}.pt") for r in range(2)]
    assert {f["layout"].split()[0] for f in finals} == {"P2xD1"}, "the survivors train on a smaller layout"
    assert all(f["restored_tier"] == "memory" for f in finals)
    assert all(STEPS > f["restored_step"] >= 4 for f in finals), [f["restored_step"] for f in finals]
    return finals


@pytest.mark.slow
def test_a_lost_node_is_recovered_from_the_survivors_memory(tmp_path: Path, uninterrupted: dict[str, Any]) -> None:
    finals = _two_nodes_lose_one(tmp_path, run=str(tmp_path / "run"))
    assert_same_params(merged_state(finals), uninterrupted)
    restart = finals[0]["report"]["restarts"][0]
    assert restart["resumed_from"] == "memory" and restart["restore_seconds"] is not None
    assert restart["layout_before"]["world_size"] == 4 and restart["layout_after"]["world_size"] == 2
    assert restart["steps_recomputed"] <= 2, "at most the snapshot interval is lost"


@pytest.mark.slow
def test_a_stream_resumes_from_the_survivors_memory_at_the_right_sample(tmp_path: Path) -> None:
    """The same loss of a node with a stream as training data (global-stream mode, 5 global batches per pass):
    the survivors resume from memory on P2xD1 at the sample after the last trained global batch."""
    loader = {"batch_size": 16, "n": 80, "stream": True}
    finals = _two_nodes_lose_one(tmp_path, run=str(tmp_path / "run"), loader=loader)
    reference = reference_run({"model": {"scheduler": True}, "loader": loader, "trainer": {"max_steps": STEPS}})
    assert_same_params(merged_state(finals), reference)


@pytest.mark.slow
def test_a_lost_node_is_recovered_while_storage_is_unreachable(tmp_path: Path, uninterrupted: dict[str, Any]) -> None:
    finals = _two_nodes_lose_one(tmp_path, run=f"gatedfile://{tmp_path / 'run'}", gate=tmp_path / "gate")
    assert_same_params(merged_state(finals), uninterrupted)
    assert list((tmp_path / "run").glob("step-*/manifest.json")), "the end checkpoint is durable once storage is back"


@pytest.mark.slow
def test_a_joining_node_receives_its_state_from_the_other_nodes_memory(tmp_path: Path) -> None:
    """One node trains P2xD1; a second joins; the new P2xD2 ranks on the new node hold nothing in memory
    and receive their stage's tensors point to point from the first node's snapshots. (The first node waits at
    step 8 until the second has joined: under load it could otherwise finish before.)"""
    steps = 40
    config = _config(tmp_path, max_steps=steps, hold={"world": 4, "step": 8})
    shm = {name: tmp_path / f"shm-{name}" for name in ("a", "b")}
    port = free_port()
    args = ["tests/workers/elastic_train.py", str(config)]
    with agents_cleanup([]) as agents:
        for name in ("a", "b"):
            env = {"SPOT_TEST_SNAPSHOT_DIR": str(shm[name])}
            agents.append(Agent(f"node-{name}", port, 2, args, tmp_path / f"{name}.log", env=env))
            if name == "a":
                wait_for(lambda: any(shm["a"].glob("*/step-000000004/rank*.json")), 240, "a snapshot", agents)
        wait_for(lambda: all(a.proc.poll() is not None for a in agents), 300, "both nodes to finish", agents)
        for agent in agents:
            assert agent.proc.returncode == 0, agent.output()[-5000:]
    finals = [torch.load(tmp_path / "out" / "final" / f"rank{r}.pt") for r in range(4)]
    assert {f["layout"].split()[0] for f in finals} == {"P2xD2"}
    assert all(f["restored_tier"] == "memory" for f in finals), [f["restored_tier"] for f in finals]
    assert all(4 <= f["restored_step"] < steps for f in finals), "the group grew in the middle of training"
    assert_same_params(merged_state(finals), reference_run({**CASE, "trainer": {"max_steps": steps}}))
    report = finals[0]["report"]
    assert report["preemptions_survived"] == 1, "torchrun stopped the workers once to let the new node in"
    restart = report["restarts"][0]
    assert restart["layout_before"]["world_size"] == 2 and restart["layout_after"]["world_size"] == 4
    assert_restart_phases(restart, notice=True)  # torchrun's SIGTERM to the workers


def test_time_based_snapshots_are_agreed_by_all_ranks(tmp_path: Path) -> None:
    """snapshot_every_n_seconds: clocks differ between ranks, so they agree on the steps (one all-reduce)."""
    from tests.distributed import launch

    config = _config(
        tmp_path,
        max_steps=12,
        every=None,
        snapshot_every=None,
        snapshot_every_seconds=0.6,
        snapshot_dir=str(tmp_path / "shm"),
    )
    launch(2, ["tests/workers/elastic_train.py", str(config)], log_dir=tmp_path / "logs", timeout=240)
    steps = [torch.load(tmp_path / "out" / "final" / f"rank{r}.pt")["snapshot_steps"] for r in range(2)]
    assert steps[0] == steps[1], steps
    assert 3 <= len(steps[0]) <= 8, steps  # about one every 0.6 s of a ~4 s run


@pytest.mark.slow
def test_a_short_notice_hands_the_stopping_node_s_state_to_the_node_that_stays(
    tmp_path: Path, uninterrupted: dict[str, Any]
) -> None:
    """Two nodes of two workers train P2xD2 (each stage's replicas on one node: snapshots are copied to the other
    node), durable checkpoints every 4 steps. Node b gets an AWS notice 1 s from its deadline: too short for a
    durable save, so every rank keeps the step in host memory, node b's shares copied to node a, and node b leaves.
    Node a goes on alone (P2xD1) from that step in its memory, node b's stage included; equal to one process."""
    import subprocess
    import sys

    from tests.distributed import REPO

    port, metadata = free_port(), free_port()
    flag = tmp_path / "preempt-now"
    command = [sys.executable, "tests/metadata_server.py", "--cloud", "aws", "--port", str(metadata)]
    server = subprocess.Popen([*command, "--trigger", str(flag), "--lead", "1"], cwd=REPO, start_new_session=True)
    watcher = {"cloud": "aws", "poll_interval": 0.2, "endpoints": {"aws": f"http://127.0.0.1:{metadata}"}}
    config = _config(tmp_path, every=4, snapshot_every=None, snapshots=True, watch_rank=2, watcher=watcher)
    shm = {name: tmp_path / f"shm-{name}" for name in ("a", "b")}
    args = ["tests/workers/elastic_train.py", str(config)]
    try:
        wait_for(lambda: port_open(metadata), 30, "the metadata server", [])
        with agents_cleanup([]) as agents:
            for name in ("a", "b"):
                env = {"SPOT_TEST_SNAPSHOT_DIR": str(shm[name])}
                agents.append(Agent(f"node-{name}", port, 2, args, tmp_path / f"{name}.log", env=env))
                if name == "a":
                    wait_for(lambda: port_open(port), 60, "node a to host the rendezvous", agents)
            run = tmp_path / "run"
            wait_for(lambda: list(run.glob("step-000000004/manifest.json")), 240, "a checkpoint at step 4", agents)
            flag.touch()
            wait_for(lambda: agents[1].proc.poll() is not None, 120, "node b to leave", agents[:1])
            wait_for(lambda: agents[0].proc.poll() is not None, 300, "node a to finish", agents[:1])
            assert agents[0].proc.returncode == 0, agents[0].output()[-5000:]
            said = agents[0].output() + agents[1].output()
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=10)
    assert "is kept in host memory instead (copied to the next node)" in said, said[-4000:]
    finals = [torch.load(tmp_path / "out" / "final" / f"rank{r}.pt") for r in range(2)]
    assert {f["layout"].split()[0] for f in finals} == {"P2xD1"}, "node a trains on alone"
    stopped = int(re.search(r"snapshot in host memory of step (\d+) committed", said)[1])  # type: ignore[index]
    assert {(f["restored_tier"], f["restored_step"]) for f in finals} == {("memory", stopped)}
    assert_same_params(merged_state(finals), uninterrupted)
