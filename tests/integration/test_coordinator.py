"""`lightning-spot coordinator`: the rendezvous store and the torchft lighthouse of a spot job in one process; down
longer than the timeouts, the nodes end with 69 and resume from durable checkpoints; the merge of survivors over its
store. (A restart within the timeouts, twice, with nodes joining on the new store: `test_chaos.py`.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.distributed import REPO, free_port
from tests.integration.test_fault_tolerance import WORKER, _heals, _reference, _results, needs_hostname
from tests.parity import assert_same_params


def _coordinator(rdzv_port: int, lighthouse_port: int, log: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "lightning_spot_launch.coordinator", "--rdzv-port", str(rdzv_port)]
    argv += ["--lighthouse-port", str(lighthouse_port), "--log-every", "0.5"]
    with open(log, "a") as f:
        env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
        return subprocess.Popen(argv, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def _live_steps(lighthouse: str) -> dict[str, int]:
    """The step of each live pipeline, by group, on the lighthouse's page."""
    from lightning_spot.torchft.running_quorum import read_running

    running = read_running(lighthouse, timeout=2)
    return {m.group: m.step for m in running.members if m.live} if running else {}


def _pipeline_node(logs: Path, rdzv_port: int, lighthouse: str, group: int, name: str, args: list[str]) -> Any:
    """Node ``name`` of pipeline ``group``: one agent of one process, `--nnodes 1:2`, its rendezvous ``p{group}`` on
    the coordinator's store (what `lightning-spot run --coordinator` passes); its log ``pipeline{group}{name}.log``."""
    from tests.elastic import RDZV_CONF, Agent

    env = {"REPLICA_GROUP_ID": str(group), "TORCHFT_LIGHTHOUSE": lighthouse}
    log = logs / f"pipeline{group}{name}.log"
    conf = f"{RDZV_CONF},is_host=false"
    return Agent(f"{group}{name}", rdzv_port, 1, args, log, nnodes="1:2", env=env, rdzv_conf=conf, rdzv_id=f"p{group}")


@pytest.mark.slow
@needs_hostname
@pytest.mark.timeout(240)
def test_a_coordinator_down_longer_than_its_timeouts_ends_the_nodes_with_69_and_they_resume_from_durable_checkpoints(
    tmp_path: Path,
) -> None:
    """A pipeline (one agent, `--coordinator-outage 4`, `TorchFT(quorum_timeout=3)`, a durable checkpoint every 5 steps)
    trains on the coordinator; the coordinator is killed and stays down. The ranks give up on the
    lighthouse and the agent on the store: it exits with 69 (a lost peer, which every recipe relaunches; it was a
    traceback and 1, which they fail the job on). The coordinator comes back, the agent is started again (the
    scheduler's relaunch): it resumes from the newest durable checkpoint and ends equal to one process."""
    from lightning_spot.torchft.running_quorum import read_running
    from lightning_spot_launch.run import rendezvous_conf
    from tests.elastic import Agent, agents_cleanup, port_open, wait_for

    rdzv_port, lighthouse_port = free_port(), free_port()
    lighthouse = f"http://127.0.0.1:{lighthouse_port}"
    log = tmp_path / "coordinator.log"
    coordinator = _coordinator(rdzv_port, lighthouse_port, log)
    out, checkpoints, steps = tmp_path / "out", tmp_path / "checkpoints", 12
    argv = [WORKER, str(out), "--stages", "0", "--steps", str(steps), "--step-sleep", "0.2"]
    argv += ["--checkpoint", str(checkpoints), "--quorum-timeout", "3"]
    conf = f"join_timeout=120,{rendezvous_conf(last_call=1, coordinator_outage=4)}"  # (--coordinator-outage 4)

    def node(name: str) -> Agent:
        env = {"REPLICA_GROUP_ID": "0", "TORCHFT_LIGHTHOUSE": lighthouse}
        return Agent(name, rdzv_port, 1, argv, tmp_path / f"{name}.log", nnodes="1", env=env, rdzv_conf=conf)

    def step() -> int:
        running = read_running(lighthouse, timeout=2)
        return max((m.step for m in running.members), default=-1) if running else -1

    try:
        wait_for(lambda: port_open(rdzv_port) and port_open(lighthouse_port), 90, "the coordinator", [])
        with agents_cleanup([]) as agents:
            agents.append(node("first"))
            wait_for(lambda: step() >= 7, 120, "the pipeline past its checkpoint of step 5", agents)
            at_kill = step()
            coordinator.kill()
            coordinator.wait()
            killed = time.time()
            first = agents.pop()
            try:
                first.proc.wait(timeout=60)
            finally:
                first.kill()
            gave_up = time.time() - killed
            output = first.output()
            assert first.proc.returncode == 69, output[-5000:]
            assert "LighthouseLostError" in output and "exit code 69" in output, output[-5000:]
            coordinator = _coordinator(rdzv_port, lighthouse_port, log)
            wait_for(lambda: port_open(rdzv_port) and port_open(lighthouse_port), 90, "the coordinator back", [])
            agents.append(node("relaunched"))
            wait_for(lambda: agents[0].proc.poll() is not None, 120, "the relaunched pipeline to end", agents)
    finally:
        coordinator.kill()
        coordinator.wait()
    starts = [json.loads(line) for line in (out / "starts.jsonl").read_text().splitlines()]
    resumed = [s for s in starts if s["step"] > 0]
    assert [s["step"] for s in resumed] == [5], starts  # (the newest durable step)
    result = _results(out)["group0_rank0"]
    assert result["global_step"] == steps
    assert_same_params(result["state_dict"], _reference(steps))
    print(
        f"\ncoordinator gone for good: the agent exited 69 {gave_up:.1f} s after it (quorum_timeout 3 s, outage 4 s); "
        f"relaunched, the pipeline resumed from step 5 (at step {at_kill} when it went: {at_kill - 5} steps trained "
        f"again), nothing else lost"
    )


@pytest.mark.slow
@needs_hostname
@pytest.mark.timeout(300)
def test_survivors_of_two_broken_pipelines_merge_into_one_beside_a_pipeline_that_never_stops(tmp_path: Path) -> None:
    """Oobleck's merge. Three pipelines on one coordinator, an agent per node (`--nnodes 1:2`): pipeline 0, whole
    on one node with room for the model; pipelines 1 and 2 on devices of 15 kB (device_memory), which hold the tiny
    model's training state (20 kB) on two nodes, not one. Pipeline 2 has one node only (its second never came): it
    waits. Node b of pipeline 1 is lost for good: node a waits too. The two survivors merge: pipeline 2's node
    joins pipeline 1's rendezvous (its agent starts again there), and pipeline 1 trains at depth 2 again, having
    taken pipeline 0's state at the quorum's step; pipeline 0 never stops, and trains on while they wait (neither
    joins the quorum at depth 1). All end equal to one process. (A node that comes back to its own pipeline grows
    it the same way: `tests/integration/test_chaos.py`.)"""
    from tests.elastic import agents_cleanup, port_open, wait_for

    rdzv_port, lighthouse_port = free_port(), free_port()
    lighthouse = f"http://127.0.0.1:{lighthouse_port}"
    coordinator = _coordinator(rdzv_port, lighthouse_port, tmp_path / "coordinator.log")
    out, stop = tmp_path / "out", tmp_path / "stop"
    argv = [WORKER, str(out), "--stages", "0", "--steps", "400", "--step-sleep", "0.2", "--stop-file", str(stop)]
    small = [*argv, "--device-memory", "15000"]

    def node(group: int, name: str, args: list[str]) -> Any:
        return _pipeline_node(tmp_path, rdzv_port, lighthouse, group, name, args)

    def steps() -> dict[str, int]:
        return _live_steps(lighthouse)

    try:
        wait_for(lambda: port_open(rdzv_port) and port_open(lighthouse_port), 90, "the coordinator", [])
        with agents_cleanup([]) as agents:
            agents += [node(0, "a", argv), node(1, "a", small), node(1, "b", small)]
            wait_for(
                lambda: len(steps()) == 2 and min(steps().values()) >= 6, 200, "pipelines 0 and 1 at step 6", agents
            )
            agents.append(node(2, "a", small))
            lone = tmp_path / "pipeline2a.log"
            wait_for(lambda: "waits for its nodes to return" in lone.read_text(), 120, "pipeline 2 to wait", agents)
            agents[2].kill_node()  # node b of pipeline 1, gone for good
            killed, before = time.time(), steps()["0"]
            live = [agents[0], agents[1], agents[3]]

            def merged() -> list[dict[str, Any]]:
                return _heals(out, "1", after=killed)

            survivor = tmp_path / "pipeline1a.log"
            wait_for(lambda: "waits for its nodes" in survivor.read_text(), 120, "node 1a to wait", live)
            waits = time.time()
            wait_for(lambda: "joins pipeline 1, whose" in lone.read_text(), 60, "pipeline 2 to move", live)
            moves = time.time()
            assert steps()["0"] > before, "pipeline 0 must train on while the survivors wait"
            wait_for(lambda: {h["rank"] for h in merged()} == {0, 1}, 120, "the survivors merged at depth 2", live)
            trained = max(h["time"] for h in merged())
            time.sleep(2.0)
            stop.touch()
            wait_for(lambda: all(a.proc.poll() is not None for a in live), 120, "the pipelines to end", live)
            codes = [a.proc.returncode for a in live]
            assert codes == [0, 0, 0], (codes, agents[3].output()[-5000:])
    finally:
        coordinator.kill()
        coordinator.wait()
    text = lone.read_text()
    assert "pipeline 2 joins pipeline 1, whose survivors wait too" in text, text[-3000:]
    assert "it joins pipeline 1 (rendezvous p1)" in text, text[-3000:]  # (the agent, executed again)
    started = sorted(p.name.rsplit("_", 1)[0] for p in (out / "started").iterdir())
    assert started.count("group0_rank0") == 1, "pipeline 0 was restarted"
    assert "group1_rank1" in started and started.count("group2_rank0") == 1, started
    assert min(h["step"] for h in merged()) > 6, "merged at the quorum's step, never from step 0"
    assert all(h["time"] > moves for h in merged()), "node 1a must not join at depth 1: its stage does not fit"
    waited = survivor.read_text()
    assert "pipeline 1 waits for its nodes to return: at depth 1, rank 0 of this pipeline needs 19.5 KiB" in waited
    results = _results(out)
    assert sorted(results) == ["group0_rank0", "group1_rank0", "group1_rank1"], sorted(results)
    steps0 = results["group0_rank0"]["global_step"]
    assert_same_params(results["group0_rank0"]["state_dict"], _reference(steps0))
    steps1 = results["group1_rank0"]["global_step"]
    assert steps1 > min(h["step"] for h in merged()) and results["group1_rank1"]["global_step"] == steps1
    assert_same_params(
        {**results["group1_rank0"]["state_dict"], **results["group1_rank1"]["state_dict"]}, _reference(steps1)
    )
    print(
        f"\nmerge: node lost -> the merged pipeline trains at depth 2 {trained - killed:.2f} s (node 1a waits at "
        f"{waits - killed:.2f} s, pipeline 2 moves at {moves - killed:.2f} s)"
    )


@pytest.mark.slow
@needs_hostname
@pytest.mark.timeout(240)
def test_a_node_back_to_a_full_pipeline_fills_a_waiting_one(tmp_path: Path) -> None:
    """After a merge a pipeline may be full when its own node comes back (the moved node took its place). Pipeline 1
    trains on two nodes; pipeline 2 has one node on devices of 15 kB and waits. A node of pipeline 1 starts (`1c`):
    its rendezvous is full, so its agent takes the place pipeline 2 waits to fill and joins pipeline 2's rendezvous;
    pipeline 2 trains at depth 2, having taken pipeline 1's state, and pipeline 1 never stops. Both equal one
    process."""
    from tests.elastic import agents_cleanup, port_open, wait_for

    rdzv_port, lighthouse_port = free_port(), free_port()
    lighthouse = f"http://127.0.0.1:{lighthouse_port}"
    coordinator = _coordinator(rdzv_port, lighthouse_port, tmp_path / "coordinator.log")
    out, stop = tmp_path / "out", tmp_path / "stop"
    argv = [WORKER, str(out), "--stages", "0", "--steps", "400", "--step-sleep", "0.2", "--stop-file", str(stop)]
    argv += ["--device-memory", "15000"]

    def node(group: int, name: str) -> Any:
        return _pipeline_node(tmp_path, rdzv_port, lighthouse, group, name, argv)

    def steps() -> dict[str, int]:
        return _live_steps(lighthouse)

    try:
        wait_for(lambda: port_open(rdzv_port) and port_open(lighthouse_port), 90, "the coordinator", [])
        with agents_cleanup([]) as agents:
            agents += [node(1, "a"), node(1, "b")]
            wait_for(lambda: steps().get("1", 0) >= 5, 200, "pipeline 1 at step 5", agents)
            agents.append(node(2, "a"))
            lone = tmp_path / "pipeline2a.log"
            wait_for(lambda: "waits for its nodes to return" in lone.read_text(), 120, "pipeline 2 to wait", agents)
            back = time.time()
            agents.append(node(1, "c"))
            wait_for(lambda: {h["rank"] for h in _heals(out, "2", after=back)} == {0, 1}, 120, "pipeline 2", agents)
            trained = max(h["time"] for h in _heals(out, "2", after=back))
            time.sleep(1.0)
            stop.touch()
            wait_for(lambda: all(a.proc.poll() is not None for a in agents), 120, "the pipelines to end", agents)
            assert [a.proc.returncode for a in agents] == [0, 0, 0, 0], agents[3].output()[-5000:]
            text = agents[3].output()
    finally:
        coordinator.kill()
        coordinator.wait()
    assert "pipeline 1 is full (a moved node took this node's place); it joins pipeline 2 (rendezvous p2)" in text
    started = sorted(p.name.rsplit("_", 1)[0] for p in (out / "started").iterdir())
    assert started.count("group1_rank0") == started.count("group1_rank1") == 1, "pipeline 1 was restarted"
    results = _results(out)
    assert sorted(results) == ["group1_rank0", "group1_rank1", "group2_rank0", "group2_rank1"], sorted(results)
    for group in (1, 2):
        done = results[f"group{group}_rank0"]["global_step"]
        got = {**results[f"group{group}_rank0"]["state_dict"], **results[f"group{group}_rank1"]["state_dict"]}
        assert_same_params(got, _reference(done))
    print(f"\nnode back to a full pipeline: pipeline 2 trains at depth 2 {trained - back:.2f} s after the node started")
