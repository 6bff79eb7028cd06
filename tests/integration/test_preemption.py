"""Preemption on real torchrun agents: a coordinated stop, then an elastic restart on fewer or more workers.

Two torchrun agents on loopback play two nodes with 2 workers each. The run checkpoints with
SpotCheckpoint; a node leaves (SIGTERM to its agent, as a spot VM's shutdown does) or joins, the
group restarts with a new world size, picks a new layout and resumes; the final weights equal an
uninterrupted single-process run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed import REPO, free_port, launch, run_command
from tests.elastic import Agent, agents_cleanup, assert_restart_phases, port_open, wait_for
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


def _worlds(finals: list[dict]) -> set[int]:
    """World sizes of the layouts the ranks ended on (P x D, as planned for that world)."""
    return {int(p[1:]) * int(d) for p, d in (f["layout"].split("xD") for f in finals)}


@pytest.fixture(scope="module")
def uninterrupted() -> dict[str, Any]:
    return reference_run({**CASE, "trainer": {"max_steps": STEPS}})


@pytest.mark.slow
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
    assert _worlds(finals) == {2} and {f["num_nodes"] for f in finals} == {1}
    assert_same_params(merged_state(finals), uninterrupted)
    report = finals[0]["report"]
    assert report["preemptions_survived"] == 1
    restart = report["restarts"][0]
    assert restart["cause"] == "preemption notice (SIGTERM)"
    assert restart["steps_recomputed"] == 0, "the coordinated stop checkpointed the step it stopped at"
    assert restart["layout_before"]["world_size"] == 4 and restart["layout_after"]["world_size"] == 2
    assert "preemption notice on rank" in (agents[0].output() + out_b)
    assert_restart_phases(restart, notice=True)


# --------------------------------------------------------------------------- notices without torchrun
def _run_until_preempted(tmp: Path, config: Path, trigger: Callable[[], None], *, pids: list[int]) -> list[str]:
    """Launch 2 ranks; once step 2 is committed call ``trigger``; every rank must exit with code 75."""
    fired = []

    def fire() -> bool:
        if not fired and any(s >= 2 for s in _committed(tmp)):
            trigger()
            fired.append(True)
        return False

    from lightning_spot import PREEMPTED_EXIT_CODE

    return launch(
        2,
        ["tests/workers/elastic_train.py", str(config)],
        log_dir=tmp / "logs",
        timeout=240,
        expect_exit=PREEMPTED_EXIT_CODE,
        kill_when=fire,
        pids=pids,
    )


@pytest.mark.parametrize(
    "cloud", ["aws", pytest.param("gcp", marks=pytest.mark.slow), pytest.param("azure", marks=pytest.mark.slow)]
)
def test_cloud_notice_on_one_rank_stops_every_rank_with_a_checkpoint(tmp_path: Path, cloud: str) -> None:
    port = free_port()
    flag = tmp_path / "preempt-now"
    server = subprocess.Popen(
        [sys.executable, "tests/metadata_server.py", "--cloud", cloud, "--port", str(port), "--trigger", str(flag)],
        cwd=REPO,
        start_new_session=True,
    )
    try:
        wait_for(lambda: port_open(port), 30, "the metadata server", [])
        config = _config(
            tmp_path,
            max_steps=40,
            watch_rank=1,
            timeline=True,
            watcher={
                "cloud": cloud,
                "poll_interval": 0.2,
                "endpoints": {cloud: f"http://127.0.0.1:{port}"},
                "signals": [],
            },
        )
        logs = _run_until_preempted(tmp_path, config, flag.touch, pids=[])
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=10)
    last = max(_committed(tmp_path))
    manifest = json.loads((tmp_path / "run" / f"step-{last:09d}" / "manifest.json").read_text())
    assert manifest["reason"] == f"preempted: {cloud}"
    assert 2 < last < 40
    assert f"preemption notice on rank 1 ({cloud}" in logs[0]
    for rank in (0, 1):  # the timeline of each rank ends with the coordinated stop and its checkpoint
        trace = json.loads((tmp_path / "out" / "timeline" / f"rank{rank}.trace.json").read_text())
        stops = [e for e in trace["traceEvents"] if e.get("cat") == "preemption"]
        assert len(stops) == 1 and stops[0]["args"]["source"] == cloud, stops
        assert any(e.get("name") == "checkpoint copy" and e["args"]["step"] == last for e in trace["traceEvents"])
    if cloud == "gcp":  # the per-rank files merge into one trace and chart
        exe = str(Path(sys.executable).parent / "lightning-spot")
        merged = subprocess.run(
            [exe, "timeline", str(tmp_path / "out" / "timeline")], capture_output=True, text=True, timeout=120
        )
        assert merged.returncode == 0, merged.stderr
        events = json.loads((tmp_path / "out" / "timeline" / "trace.json").read_text())["traceEvents"]
        assert {e["pid"] for e in events if e.get("cat") == "preemption"} == {0, 1}
        assert (tmp_path / "out" / "timeline" / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    if cloud in ("aws", "azure"):  # these notices carry a deadline
        assert re.search(r"committed in [\d.]+s; [\d.]+s left before the deadline", logs[0]), logs[0][-2000:]


@pytest.mark.slow
def test_a_notice_shorter_than_a_durable_save_keeps_the_step_in_host_memory(tmp_path: Path) -> None:
    """An AWS notice whose deadline is a second away: less than a durable checkpoint and the rest of the stop
    need. Every rank keeps the step in host memory instead (written before the exit), the log says so, and the
    restart resumes from that snapshot, not from the older durable checkpoint; training equals one process."""
    port = free_port()
    flag = tmp_path / "preempt-now"
    command = [sys.executable, "tests/metadata_server.py", "--cloud", "aws", "--port", str(port)]
    server = subprocess.Popen([*command, "--trigger", str(flag), "--lead", "1"], cwd=REPO, start_new_session=True)
    watcher = {"cloud": "aws", "poll_interval": 0.2, "endpoints": {"aws": f"http://127.0.0.1:{port}"}, "signals": []}
    config = _config(tmp_path, every=4, snapshots=True, snapshot_dir=str(tmp_path / "shm"), watcher=watcher)
    try:
        wait_for(lambda: port_open(port), 30, "the metadata server", [])
        logs = _run_until_preempted(tmp_path, config, flag.touch, pids=[])
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=10)
    said = re.search(r"snapshot in host memory of step (\d+) committed in [\d.]+s; -?[\d.]+s left", logs[0])
    assert said, logs[0][-3000:]
    stopped = int(said[1])
    assert "is kept in host memory instead" in logs[0] and stopped not in _committed(tmp_path), logs[0][-3000:]
    launch(2, ["tests/workers/elastic_train.py", str(config)], log_dir=tmp_path / "logs2", timeout=240)
    finals = _finals(tmp_path, 2)
    assert {(f["restored_tier"], f["restored_step"]) for f in finals} == {("memory", stopped)}
    assert_same_params(merged_state(finals), reference_run({**CASE, "trainer": {"max_steps": STEPS}}))


def test_notice_during_a_background_save_finishes_that_save_first(tmp_path: Path) -> None:
    """SIGTERM while step 4 is still uploading: that save completes, then the current step is saved too."""
    marker = tmp_path / "uploading"
    config = _config(tmp_path, max_steps=40, run=f"slowfile://{tmp_path / 'run'}", watcher={"cloud": None})
    pids: list[int] = []
    sent = []

    def sigterm_during_upload() -> bool:
        if marker.exists() and not sent:
            os.kill(pids[1], signal.SIGTERM)  # rank 1, while rank 0's upload of step 4 is stalled
            sent.append(True)
        return False

    from lightning_spot import PREEMPTED_EXIT_CODE

    launch(
        2,
        ["tests/workers/elastic_train.py", str(config)],
        log_dir=tmp_path / "logs",
        timeout=240,
        expect_exit=PREEMPTED_EXIT_CODE,
        kill_when=sigterm_during_upload,
        pids=pids,
        env={"SPOT_TEST_SLOW_STEP": "4", "SPOT_TEST_MARKER": str(marker), "SPOT_TEST_SLOW_SECONDS": "3"},
    )
    committed = _committed(tmp_path)
    assert 4 in committed and max(committed) > 4, committed
    manifest = json.loads((tmp_path / "run" / f"step-{max(committed):09d}" / "manifest.json").read_text())
    assert manifest["reason"] == "preempted: SIGTERM"


@pytest.mark.slow
def test_killed_worker_is_detected_and_the_job_resumes_from_the_last_checkpoint(
    tmp_path: Path, uninterrupted: dict
) -> None:
    """SIGKILL one worker (no notice): its peers fail fast, torchrun restarts the group, which resumes, with the
    layout decided at the first start (same processes: no profiling or planning again)."""
    config = _config(tmp_path)
    port = free_port()
    with agents_cleanup([]) as agents:
        agents.append(
            Agent("node", port, 2, ["tests/workers/elastic_train.py", str(config)], tmp_path / "a.log", nnodes="1")
        )
        wait_for(lambda: any(s >= 4 for s in _committed(tmp_path)), 240, "a checkpoint at step 4", agents)
        victim = int((tmp_path / "out" / "pids" / "rank1-attempt0.pid").read_text())
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: agents[0].proc.poll() is not None, 300, "the restarted job to finish", agents)
        assert agents[0].proc.returncode == 0, agents[0].output()[-5000:]
    finals = _finals(tmp_path, 2)
    assert all(f["restored_step"] >= 4 for f in finals)
    assert_same_params(merged_state(finals), uninterrupted)
    restart = finals[0]["report"]["restarts"][0]
    assert restart["cause"] == "failure (no notice)" and restart["resumed_from_step"] >= 4
    assert_restart_phases(restart, notice=False)
    log = agents[0].output()
    # the restart runs on the same processes: the first start's decision is kept, nothing profiled again
    plans = log.split("spot_pipeline plan:")
    assert len(plans) == 3 and "profiling layers" not in plans[1], log[-5000:]
    assert "kept without profiling" in plans[2], plans[2][:2000]


@pytest.mark.slow
def test_run_wrapper_trains_a_job(tmp_path: Path, uninterrupted: dict) -> None:
    config = _config(tmp_path, step_seconds=0.0)
    exe = str(Path(sys.executable).parent / "lightning-spot")
    run_command(
        [exe, "run", "--nproc-per-node", "2", "tests/workers/elastic_train.py", str(config)],
        timeout=300,
    )
    assert_same_params(merged_state(_finals(tmp_path, 2)), uninterrupted)
