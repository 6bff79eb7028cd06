"""Start torchrun agents ("nodes") on loopback for elastic tests; stop them by process id."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from lightning_spot_launch.run import rendezvous_conf
from tests.distributed import REPO

#: the rendezvous settings of the test agents: lightning-spot run's heartbeat; a round closes 3 s after its last member
#: arrived (1 s more than lightning-spot run: test agents start together on a loaded machine)
RDZV_CONF = f"join_timeout=120,{rendezvous_conf(last_call=3)}"


class Agent:
    """One torchrun agent with ``nproc`` workers, logging to ``log``."""

    def __init__(
        self,
        name: str,
        port: int,
        nproc: int,
        script_args: list[str],
        log: Path,
        nnodes: str = "1:2",
        env: dict[str, str] | None = None,
        max_restarts: int = 3,
        rdzv_conf: str = RDZV_CONF,
        rdzv_id: str = "spot-test",
    ) -> None:
        self.name = name
        self.log_path = log
        self.log = open(log, "w")
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "PYTHONUNBUFFERED": "1",
            # several agents on one machine stand in for nodes: each sizes its threads for a whole machine
            "OMP_NUM_THREADS": "1",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",  # a fresh store per round (see FIELD-NOTES)
            **(env or {}),
        }
        env.pop("LOCAL_RANK", None)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "lightning_spot_launch",
                f"--nnodes={nnodes}",
                f"--nproc-per-node={nproc}",
                f"--max-restarts={max_restarts}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                f"--rdzv-id={rdzv_id}",
                f"--rdzv-conf={rdzv_conf}",
                "--monitor-interval=0.5",
                *script_args,
            ],
            env=env,
            cwd=REPO,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)  # the agent itself, which forwards SIGTERM to its workers

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
        self.log.close()

    def kill_node(self) -> None:
        """The whole "node" dies at once, without notice: the agent and every process under it (torchrun
        starts workers in sessions of their own, so killing the agent's process group is not enough)."""
        victims = [self.proc.pid, *descendants(self.proc.pid)]
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.kill()

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")


def descendants(pid: int) -> list[int]:
    """Process ids under ``pid`` (children, grandchildren, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def port_open(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def wait_for(condition: Callable[[], bool], timeout: float, what: str, agents: list[Agent]) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        dead = [a for a in agents if a.proc.poll() not in (None, 0)]
        if dead or time.monotonic() > deadline:
            logs = "\n".join(f"----- {a.name} -----\n{a.output()[-5000:]}" for a in agents)
            raise AssertionError(f"{'an agent failed' if dead else 'timed out'} while waiting for {what}\n{logs}")
        time.sleep(0.3)


@contextmanager
def agents_cleanup(agents: list[Agent]) -> Iterator[list[Agent]]:
    try:
        yield agents
    finally:
        for agent in agents:
            agent.kill()


def assert_restart_phases(restart: dict[str, Any], *, notice: bool) -> None:
    """A restart of a run's report (``journal.summarize``): its phases are all measured, positive, and add up to
    the time it lost; a stop phase exactly when a notice caused it."""
    phases = restart["phases"]
    assert (phases["stop"] is not None) == notice, phases
    timed = [phases[k] for k in ("restart", "setup", "restore", "first_step")]
    assert all(t is not None and t >= 0 for t in timed) and phases["setup"] > 0, phases
    assert sum(timed) == pytest.approx(restart["time_lost_seconds"], abs=0.01), phases
