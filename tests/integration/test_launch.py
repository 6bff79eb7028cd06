"""lightning-spot run's agent (``python -m lightning_spot_launch``): restarted workers are forks of a server that
imported Lightning already; a node that leaves the rendezvous is not waited for."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed import REPO

WORKER = """
import json, os, sys
preloaded = "lightning.pytorch" in sys.modules  # before this script imports anything
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
out = os.path.join(sys.argv[1], f"rank{os.environ['RANK']}-attempt{attempt}.json")
with open(out, "w") as f:
    json.dump({"preloaded": preloaded, "agent": os.environ.get("LIGHTNING_SPOT_AGENT_PID"), "argv": sys.argv,
               "name": __name__, "path0": sys.path[0], "omp": os.environ.get("OMP_NUM_THREADS")}, f)
if attempt == 0 and os.environ["RANK"] == "1":
    raise SystemExit(75)  # a preemption exit: the agent restarts both workers
"""


def _launch(tmp_path: Path, *flags: str) -> dict[str, dict]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(REPO)
    cmd = [sys.executable, "-m", "lightning_spot_launch", "--standalone", "--nproc-per-node=2", "--max-restarts=1"]
    proc = subprocess.run([*cmd, *flags, str(script), str(tmp_path)], env=env, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    return {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("rank*-attempt*.json")}


def test_restarted_workers_are_forks_of_a_preloaded_server(tmp_path: Path) -> None:
    runs = _launch(tmp_path)
    assert sorted(runs) == ["rank0-attempt0", "rank0-attempt1", "rank1-attempt0", "rank1-attempt1"]
    for run in runs.values():
        assert run["preloaded"], "torch and Lightning are imported once, by the fork server"
        assert run["name"] == "__main__" and run["argv"] == [str(tmp_path / "worker.py"), str(tmp_path)]
        assert run["path0"] == str(tmp_path), "the script's directory comes first, as with python script.py"
        assert run["agent"] and int(run["agent"]) != os.getpid()
        assert run["omp"] is None, "torchrun's OMP_NUM_THREADS=1 default is left out: each rank sizes its pool"


def test_fresh_processes_start_new_interpreters(tmp_path: Path) -> None:
    runs = _launch(tmp_path, "--fresh-processes")
    assert len(runs) == 4 and not any(r["preloaded"] for r in runs.values())


FAILING = """
import os, pathlib, sys
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
pathlib.Path(sys.argv[1], f"rank{os.environ['RANK']}-attempt{attempt}").touch()
if os.environ["RANK"] == "1" and sys.argv[2] == "error":
    raise ValueError("a bug in training_step")
if os.environ["RANK"] == "1" and sys.argv[2] == "peer" and attempt < 2:
    sys.excepthook = lambda *exc: os._exit(69)  # what lightning_spot's failure handling sets for a lost peer
    raise RuntimeError("Connection closed by peer")
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_error_is_restarted_max_failures_times_a_lost_peer_as_often_as_preemptions(tmp_path: Path) -> None:
    """An exception of the job's code (exit code 1) is run again --max-failures times, then ends the job (torchrun
    alone would run it --max-restarts times); a rank that exits because it lost a peer (69, set in sys.excepthook,
    which forked workers now run as ``python script.py`` does) is restarted however small --max-failures is."""
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(REPO)
    cmd = [sys.executable, "-m", "lightning_spot_launch", "--standalone", "--nproc-per-node=2", "--max-restarts=5"]
    runs: dict[str, subprocess.CompletedProcess[bytes]] = {}
    for name, kind, flags in (("error", "error", ["--max-failures=1"]), ("peer", "peer", ["--max-failures=0"])):
        out = tmp_path / name
        out.mkdir()
        runs[name] = subprocess.run(
            [*cmd, *flags, str(script), str(out), kind], env=env, capture_output=True, timeout=200
        )
    # (restarts spent on lost peers: the agent's exit code says so, for a scheduler that recovers the job on it)
    (tmp_path / "spent").mkdir()
    spent = [*cmd[:-1], "--max-restarts=1", str(script), str(tmp_path / "spent"), "peer"]
    runs["spent"] = subprocess.run(spent, env=env, capture_output=True, timeout=200)
    error, peer = runs["error"], runs["peer"]
    assert runs["spent"].returncode == 69, runs["spent"].stderr.decode()[-3000:]
    assert error.returncode == 1, error.stderr.decode()[-3000:]
    assert sorted(p.name for p in (tmp_path / "error").glob("rank1-*")) == ["rank1-attempt0", "rank1-attempt1"]
    assert "not restarting again (--max-failures 1)" in error.stderr.decode(), error.stderr.decode()[-3000:]
    assert peer.returncode == 0, peer.stderr.decode()[-3000:]
    assert sorted(p.name for p in (tmp_path / "peer").glob("rank1-*")) == [f"rank1-attempt{a}" for a in range(3)]


SLEEPER = """
import pathlib, sys, time
pathlib.Path(sys.argv[1], "ready").touch()
time.sleep(120)
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_lightning_spot_run_stopped_by_a_notice_exits_75(tmp_path: Path) -> None:
    """A scheduler's SIGTERM to ``lightning-spot run`` (the process it started: the agent took its place) reaches the
    agent, which stops its workers, leaves, and exits 75: the code schedulers are told to recover on."""
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(REPO)
    cmd = [sys.executable, "-m", "lightning_spot.cli", "run", "--nproc-per-node", "1", str(script), str(tmp_path)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 75, err.decode()[-3000:]
        assert "stopped by SIGTERM: exit code 75" in err.decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(60)
def test_an_agent_that_cannot_reach_its_coordinator_exits_69(tmp_path: Path) -> None:
    """A node (re)started while its coordinator is down: the rendezvous fails, and the agent exits with 69, which
    every recipe relaunches (it was a traceback and exit code 1, which they fail the job on)."""
    from tests.distributed import free_port

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(REPO)
    cmd = [sys.executable, "-m", "lightning_spot_launch", "--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d"]
    cmd += [f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-conf=is_host=false,read_timeout=2", "x.py"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 69, proc.stderr[-3000:]
    assert "the rendezvous failed (RendezvousConnectionError" in proc.stderr and "exit code 69" in proc.stderr
