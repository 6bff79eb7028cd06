"""Test workers forked from one interpreter that has imported torch and Lightning once.

Every rank of every job a test launches used to start a new interpreter and import torch, Lightning and
lightning_spot: 4-7 s of CPU each, which on a 2-core machine was most of the suite's time. The session now keeps
one server process that imports them (``PRELOAD``) and forks a worker per rank; a worker then behaves as
``python script args`` with its own environment, working directory, output file and session:

    server = fork_server()                                   # started on first use, stopped at exit
    proc = server.spawn(["tests/workers/x.py", "out"], env=env, cwd=REPO, log=path)
    proc.poll(); proc.wait(timeout=10); proc.pid; proc.returncode   # as subprocess.Popen's

What a fork inherits that a new interpreter would set from its environment is set again in the worker (the thread
pool from ``OMP_NUM_THREADS``, Lightning's rank for ``rank_zero_only``); string hashes stay the server's (ranks of a
job hash alike, as workers of ``lightning-spot run``'s own fork server do). ``SPOT_TESTS_FRESH_PROCESSES=1`` starts
new interpreters instead (``tests.distributed`` falls back to ``subprocess.Popen``), as outside the test session
(benchmarks time workers started as users start them).
"""

from __future__ import annotations

import atexit
import importlib
import io
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

from lightning_spot_launch.forked import PRELOAD as LAUNCHER_PRELOAD

REPO = Path(__file__).resolve().parents[1]
#: what the server imports once: what ``lightning-spot run``'s fork server preloads, and the tests' own helpers
PRELOAD = (*LAUNCHER_PRELOAD, "tests.parity")

_enabled = False


def use_forks(enabled: bool = True) -> None:
    """Fork workers from now on (the test session turns this on; benchmarks keep new interpreters, as users run)."""
    global _enabled
    _enabled = enabled


def forking() -> bool:
    """Whether workers are forks of the server (unless ``SPOT_TESTS_FRESH_PROCESSES=1`` asks for new interpreters)."""
    return _enabled and os.environ.get("SPOT_TESTS_FRESH_PROCESSES", "") in ("", "0")


# ============================================================================= the test process's side
class ForkedProcess:
    """A worker forked by the server, with the part of ``subprocess.Popen``'s interface the tests use."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self._server = server
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The server process (started with the environment the test process has then) and a connection to it."""

    def __init__(self) -> None:
        self.address = address = os.path.join(tempfile.mkdtemp(prefix="spot-forks-"), "server")
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "LOCAL_RANK")}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fork_server", address], cwd=REPO, env=env, start_new_session=True
        )
        deadline = time.monotonic() + 180
        while not os.path.exists(address):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the tests' fork server did not start (exit code {self.proc.returncode})")
            time.sleep(0.05)
        self.conn: Connection = Client(address, family="AF_UNIX")
        self._lock = threading.Lock()

    def _ask(self, *request: Any) -> Any:
        with self._lock:
            self.conn.send(request)
            answer = self.conn.recv()
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def spawn(self, argv: Sequence[str], *, env: dict[str, str], cwd: Path | str, log: Path | str) -> ForkedProcess:
        """``python *argv`` (a script or ``-m module``), output (both streams) to ``log``, leading its own session."""
        open(log, "w").close()  # there as soon as this returns (tests read it while the worker runs), as with Popen
        return ForkedProcess(self, self._ask("spawn", list(argv), dict(env), str(cwd), str(log)))

    def exit_code(self, pid: int) -> int | None:
        """The worker's exit code as ``Popen.returncode`` gives it; ``None`` while it runs."""
        return self._ask("poll", pid)

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the server, not its workers
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
        shutil.rmtree(os.path.dirname(self.address), ignore_errors=True)


_server: ForkServer | None = None


def fork_server() -> ForkServer:
    """The session's server (started on first use; stopped by :func:`stop_fork_server` or at exit)."""
    global _server
    if _server is None or _server.proc.poll() is not None:
        _server = ForkServer()
        atexit.register(_server.close)
    return _server


def stop_fork_server() -> None:
    """Stop the session's server (its pid), if one was started."""
    global _server
    if _server is not None:
        _server.close()
        _server = None


# ====================================================================================== the server's side
def serve(address: str) -> None:
    for module in PRELOAD:
        importlib.import_module(module)
    # a fork copies a thread's locks but not the thread (numpy's OpenBLAS pool, not a Python thread, handles forks)
    if threading.active_count() != 1:
        raise SystemExit(f"tests' fork server: {threading.enumerate()} after importing {PRELOAD}: forks are not safe")
    listener = Listener(address, family="AF_UNIX")
    conn = listener.accept()
    listener.close()  # one client: the test process
    exits: dict[int, int] = {}
    while True:
        _reap(exits)
        if not conn.poll(0.02):
            continue
        try:
            request = conn.recv()
        except EOFError:  # the test process has gone
            return
        try:
            if request[0] == "spawn":
                answer: Any = _spawn(*request[1:], connection=conn)
            else:
                _reap(exits)
                answer = exits.pop(request[1], None)
        except Exception as err:  # (sent back: raised in the test process)
            answer = err
        conn.send(answer)


def _reap(exits: dict[int, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        exits[pid] = os.waitstatus_to_exitcode(status)


def _spawn(argv: list[str], env: dict[str, str], cwd: str, log: str, connection: Connection) -> int:
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker
        code = 1
        try:
            os.close(ready_r)
            os.setsid()  # before the test process learns the pid: it kills by process group
            os.close(ready_w)
            connection.close()
            code = _run_worker(argv, env, cwd, log)
        finally:
            os._exit(code)
    os.close(ready_w)
    os.read(ready_r, 1)  # (end of file once the worker leads its session)
    os.close(ready_r)
    return pid


def _run_worker(argv: list[str], env: dict[str, str], cwd: str, log: str) -> int:
    """Become ``python *argv``: environment, directory, output, what the interpreter sets from the environment."""
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGPIPE else signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.close(null)
    # unbuffered, as ``python -u`` / PYTHONUNBUFFERED: a killed worker's output is in its log
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True, errors="backslashreplace")
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace")
    sys.stdin = open(os.devnull)
    _as_a_new_interpreter(env)
    try:
        if argv[0] == "-m":
            sys.argv = list(argv[1:])
            sys.path[0] = cwd
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except BaseException:
        sys.excepthook(*sys.exc_info())  # (lightning_spot's failure handling sets its exit code there)
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter does: wait for non-daemon threads
    atexit._run_exitfuncs()
    return code


def _as_a_new_interpreter(env: dict[str, str]) -> None:
    """What a new interpreter takes from its environment at start and the server took from its own."""
    import torch
    from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank
    from lightning.pytorch.utilities.rank_zero import rank_zero_only
    from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank

    threads = env.get("OMP_NUM_THREADS") or env.get("MKL_NUM_THREADS")
    if threads and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))  # (OpenMP read the server's environment when torch was loaded)
    rank = next((int(env[k]) for k in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK") if k in env), 0)
    for holder in (fabric_rank, rank_zero_only, utils_rank):
        holder.rank = rank  # type: ignore[attr-defined]


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    serve(sys.argv[1])
