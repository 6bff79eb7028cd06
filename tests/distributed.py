"""Launch real multi-process jobs (CPU, gloo) from tests, with a hard timeout and cleanup by process id."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.fork_server import ForkedProcess, fork_server, forking

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class WorkerFailure(AssertionError):
    """A launched worker failed or the job timed out; carries every rank's output."""

    def __init__(self, message: str, logs: list[str]) -> None:
        super().__init__(
            message + "\n" + "\n".join(f"----- rank {r} -----\n{log[-6000:]}" for r, log in enumerate(logs))
        )
        self.logs = logs


def _kill(procs: Sequence[subprocess.Popen | ForkedProcess]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


@contextmanager
def _running(
    world_size: int, argv: Sequence[str], log_dir: Path, env: dict[str, str] | None
) -> Iterator[list[subprocess.Popen | ForkedProcess]]:
    """``python *argv`` as ``world_size`` ranks, each leading its own session, output to rank<N>.log; whatever is
    still running on the way out is killed by process group and the logs are closed."""
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen | ForkedProcess] = []
    files = []
    try:
        for rank in range(world_size):
            rank_env = {
                **os.environ,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(world_size),
                "NODE_RANK": "0",
                "LOCAL_RANK": str(rank),
                "RANK": str(rank),
                "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                "PYTHONUNBUFFERED": "1",
                **(env or {}),
            }
            log = log_dir / f"rank{rank}.log"
            if forking():  # a fork of the test session's preloaded interpreter (tests/fork_server.py)
                procs.append(fork_server().spawn(argv, env=rank_env, cwd=REPO, log=log))
                continue
            out = open(log, "w")
            files.append(out)
            procs.append(
                subprocess.Popen(
                    [sys.executable, *argv],
                    env=rank_env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=REPO,
                    start_new_session=True,
                )
            )
        yield procs
    finally:
        _kill(procs)
        for f in files:
            f.close()


def _logs(log_dir: Path, world_size: int) -> list[str]:
    return [(log_dir / f"rank{r}.log").read_text(errors="replace") for r in range(world_size)]


def launch(
    world_size: int,
    argv: Sequence[str],
    *,
    log_dir: Path,
    timeout: float = 240.0,
    env: dict[str, str] | None = None,
    kill_when: Callable[[], bool] | None = None,
    expect_exit: int = 0,
    pids: list[int] | None = None,
) -> list[str]:
    """Run ``python *argv`` as ``world_size`` ranks (Lightning's LOCAL_RANK/WORLD_SIZE protocol).

    Returns each rank's combined output. If any rank fails, the others are killed at once and
    :class:`WorkerFailure` is raised; the same after ``timeout`` seconds. ``kill_when`` is polled
    while the job runs: when it returns True every rank gets SIGKILL (a simulated crash) and the
    logs are returned. ``expect_exit`` is the exit code that counts as success for every rank;
    ``pids``, if given, receives the ranks' process ids as soon as they start.
    """
    with _running(world_size, argv, log_dir, env) as procs:
        if pids is not None:
            pids.extend(p.pid for p in procs)
        deadline = time.monotonic() + timeout
        failed = None
        killed = False
        while time.monotonic() < deadline:
            if kill_when is not None and kill_when():
                _kill(procs)
                killed = True
                break
            codes = [p.poll() for p in procs]
            failed = next((r for r, c in enumerate(codes) if c not in (None, expect_exit)), None)
            if failed is not None or all(c == expect_exit for c in codes):
                break
            time.sleep(0.2)
        timed_out = any(p.poll() is None for p in procs) and failed is None and not killed
    logs = _logs(log_dir, world_size)
    if killed:
        return logs
    if failed is not None:
        raise WorkerFailure(f"rank {failed} exited with code {procs[failed].returncode}", logs)
    if timed_out:
        raise WorkerFailure(f"job did not finish within {timeout:.0f}s (hang?)", logs)
    return logs


@dataclass
class Exits:
    """How every rank of a job ended: exit codes (``None``: still running at the deadline, then killed), the
    wall-clock time each exit was seen, and each rank's output."""

    codes: list[int | None]
    times: list[float | None]
    logs: list[str]


def run_until_exit(
    world_size: int,
    argv: Sequence[str],
    *,
    log_dir: Path,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    after_first_exit: float = 30.0,
) -> Exits:
    """Run ``python *argv`` as ``world_size`` ranks and let every rank end by itself (nothing is killed when one
    fails): wait until all have exited, ``timeout`` has passed, or ``after_first_exit`` seconds have passed since
    the first exit; then kill what is left (by process group) and report."""
    codes: list[int | None] = [None] * world_size
    times: list[float | None] = [None] * world_size
    with _running(world_size, argv, log_dir, env) as procs:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and None in codes:
            for r, p in enumerate(procs):
                if codes[r] is None and p.poll() is not None:
                    codes[r], times[r] = p.returncode, time.time()
                    deadline = min(deadline, time.monotonic() + after_first_exit)
            time.sleep(0.05)
    return Exits(codes, times, _logs(log_dir, world_size))


def run_command(argv: Sequence[str], timeout: float = 240, env: dict[str, str] | None = None) -> str:
    """Run a command that starts its own worker processes (Lightning's launcher, torchrun); return its output.

    The command leads a new process group, which is killed as a whole on timeout or afterwards.
    """
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO), **(env or {})}
    full_env.pop("LOCAL_RANK", None)
    proc = subprocess.Popen(
        list(argv),
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s:\n{out[-5000:]}") from None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, out[-8000:]
    return out
