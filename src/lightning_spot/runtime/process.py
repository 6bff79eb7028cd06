"""This process's setup and teardown: CPU threads for tensor ops, and the process group at exit.

    setup = set_up_threads(local_processes=4)       # every rank, before any work; a user's choice wins
    setup.describe()                                 # "1 thread per process (2 CPUs / 4 processes on this node)"
    destroy_process_group_at_exit()                  # once, after the process group exists
    devices, nodes = elastic_world(devices)          # under torchrun: the world the environment says

Why threads matter: torch sizes each process's OpenMP team for the whole machine. When several
ranks share a node's cores, every parallel op ends in a team barrier that waits for a thread the
OS has descheduled; on 2 cores with 4 ranks a step took 10x longer while the cores sat idle.
Lightning's own DDP strategy avoids this through its launcher, which sizes the pool in every
process; here every rank does it for itself, whichever way it was started (Lightning's launcher,
LightningCLI, torchrun), with the same rule: the CPUs this process may run on / the processes on
this node, at least 1.
"""

from __future__ import annotations

import atexit
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

#: what the process had when lightning_spot was imported: a later change is the user's own choice
_THREADS_AT_IMPORT = torch.get_num_threads()
_ENV_AT_IMPORT = {name: os.environ.get(name) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
_IMPORTED_AT = time.time()


@dataclass(frozen=True)
class ThreadSetup:
    """The intra-op thread count of this process and where it came from."""

    threads: int
    #: ``"rule"`` (chosen here), ``"environment"`` (OMP_NUM_THREADS / MKL_NUM_THREADS) or ``"user"``
    #: (``torch.set_num_threads`` called after ``import lightning_spot``)
    source: str
    detail: str

    def describe(self) -> str:
        per = "thread" if self.threads == 1 else "threads"
        return f"{self.threads} CPU {per} per process for tensor ops ({self.detail})"


def cpus_available() -> int:
    """The CPUs this process may run on (its affinity mask, as in containers and under taskset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def suggested_threads(local_processes: int) -> int:
    """The rule: the CPUs this process may use, shared evenly by the processes on this node."""
    return max(1, cpus_available() // max(1, local_processes))


def _set_by_torchrun(value: str | None) -> bool:
    """torchrun gives its workers ``OMP_NUM_THREADS=1`` when its own environment has none: then it is
    torchrun's default, not the user's choice (the agent's initial environment tells, on Linux)."""
    if value != "1" or "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    try:
        parent = Path(f"/proc/{os.getppid()}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return not any(entry.startswith(b"OMP_NUM_THREADS=") for entry in parent)


def threads_set_by_user() -> int | None:
    """The intra-op thread count if ``torch.set_num_threads`` was called since ``import lightning_spot``.

    Read it when the strategy is created: Lightning's launcher resets the pool of the process it runs
    in before the strategy sets up.
    """
    current = torch.get_num_threads()
    return current if current != _THREADS_AT_IMPORT else None


def set_up_threads(local_processes: int, user_threads: int | None = None) -> ThreadSetup:
    """Size this process's intra-op thread pool, unless the user chose (see the module docstring).

    ``user_threads``: what :func:`threads_set_by_user` said earlier (kept, and restored if changed since).
    """
    for name, value in _ENV_AT_IMPORT.items():
        if value is not None and not (name == "OMP_NUM_THREADS" and _set_by_torchrun(value)):
            return ThreadSetup(torch.get_num_threads(), "environment", f"{name}={value} in the environment")
    if user_threads is not None:
        torch.set_num_threads(user_threads)
        return ThreadSetup(user_threads, "user", "torch.set_num_threads was called")
    current = torch.get_num_threads()
    # Lightning's launcher sizes the pool of the process it runs in by the same rule, and says so in the environment
    by_lightning = os.environ.get("OMP_NUM_THREADS") == str(current)
    if current != _THREADS_AT_IMPORT and not by_lightning:
        return ThreadSetup(current, "user", "torch.set_num_threads was called")
    threads = suggested_threads(local_processes)
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # for processes this one starts (data loader workers)
    plural = "process" if local_processes == 1 else "processes"
    return ThreadSetup(threads, "rule", f"{cpus_available()} CPUs / {local_processes} {plural} on this node")


def process_started() -> float:
    """Wall-clock time (``time.time()``) at which this process started, to ~10 ms: read from ``/proc`` on Linux
    (the process's age on the boot clock), else the time lightning_spot was imported (later: imports come first).
    It splits a restart into the launcher's part (until the process exists) and the process's own set-up."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of proc(5): starttime
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - started_after_boot)
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED_AT


_exit_hook_registered = False


def destroy_process_group_at_exit() -> None:
    """Destroy the process group in an ``atexit`` hook, while the interpreter is still whole.

    A gloo worker thread drops its reference to the last collective's tensors only after the caller
    has seen the result; if the process exits right after a collective (the ``SystemExit(75)`` of a
    preemption stop does), that thread needs the GIL during interpreter finalization and the process
    aborts with "terminate called without an active exception" (pytorch/pytorch#190489). Destroying
    the group and yielding the GIL briefly while the interpreter is whole avoids that.
    """
    global _exit_hook_registered
    if _exit_hook_registered:
        return
    _exit_hook_registered = True

    def destroy() -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
            time.sleep(0.2)  # let gloo's threads take the GIL and release what they hold

    atexit.register(destroy)


def elastic_world(devices: list[torch.device]) -> tuple[list[torch.device], Optional[int]]:
    """Under torchrun: this node's devices and the node count (``None``: unknown) from ``LOCAL_WORLD_SIZE`` and
    ``WORLD_SIZE``. After an elastic restart the group may be smaller or larger than the Trainer's ``devices`` x
    ``num_nodes``; the environment is what is true."""
    env = os.environ
    if "LOCAL_WORLD_SIZE" not in env or "WORLD_SIZE" not in env or not devices:
        return devices, None
    local, world = int(env["LOCAL_WORLD_SIZE"]), int(env["WORLD_SIZE"])
    if len(devices) != local:
        kind = devices[0].type
        devices = [torch.device(kind, i) for i in range(local)] if kind != "cpu" else [torch.device("cpu")] * local
    return devices, (world // local if world % local == 0 else None)
