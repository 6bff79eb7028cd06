"""A node that moves to another pipeline: its workers asked for it, its agent joins that pipeline's rendezvous.

    os.environ.update(worker_env(config, os.getpid()))   # before the agent starts: what the workers need to ask
    watch_moves()                       # patches torchrun's agent: workers exiting with MOVED_EXIT_CODE end its run
    ...
    except MovedToPipeline as moved:    # (out of the agent's run, after it stopped its workers and left)
        entrypoint, args = relaunch_as(moved.target, config, base_entrypoint, base_args)   # then run it again

Each pipeline of a torchft job has its own rendezvous (``--rdzv-id``) and ``REPLICA_GROUP_ID``. The survivors of a
pipeline that cannot hold the model wait for their nodes; when another pipeline's survivors wait too and together
they are enough nodes, one of them moves (``lightning_spot.torchft.merge`` decides, over the coordinator's store):
its workers write the target into :data:`MOVE_FILE_ENV`'s file and exit with :data:`MOVED_EXIT_CODE`, and the agent
leaves its rendezvous (it stays open: that pipeline may come back) and runs again, in the same process, as a node
of the target (its rendezvous id, its ``REPLICA_GROUP_ID``; its warm fork server kept: the workers start without
importing torch again), whose agent sees a node waiting and starts its pipeline again, deeper.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_spot_launch import MOVED_EXIT_CODE

#: where a worker writes the pipeline its node moves to (one file per agent)
MOVE_FILE_ENV = "LIGHTNING_SPOT_MOVE_FILE"
#: the rendezvous store shared by every pipeline (a coordinator's); unset when each pipeline hosts its own
SHARED_STORE_ENV = "LIGHTNING_SPOT_SHARED_STORE"
#: the most nodes this pipeline's rendezvous takes (``--nnodes MIN:MAX``)
MAX_NODES_ENV = "LIGHTNING_SPOT_MAX_NODES"


@dataclass(frozen=True)
class Target:
    """The pipeline a node moves to: its ``REPLICA_GROUP_ID`` and rendezvous id."""

    group: str
    run_id: str


class MovedToPipeline(Exception):
    """The workers left to join another pipeline (raised out of the agent's monitor)."""

    def __init__(self, target: Target) -> None:
        super().__init__(f"moving to pipeline {target.group} (rendezvous {target.run_id})")
        self.target = target


def worker_env(config: Any, agent_pid: int) -> dict[str, str]:
    """What the workers need to ask for a move: this agent's move file, the most nodes its rendezvous takes and,
    when the rendezvous store is a coordinator's (shared by every pipeline), its address."""
    env = {
        MOVE_FILE_ENV: os.path.join(tempfile.gettempdir(), f"lightning-spot-move-{agent_pid}.json"),
        MAX_NODES_ENV: str(config.max_nodes),
    }
    if str(config.rdzv_configs.get("is_host", "true")).lower() in ("false", "0", "no"):
        env[SHARED_STORE_ENV] = config.rdzv_endpoint
    return env


def write_move(target: Target) -> None:
    """(A worker) tell the agent where its node goes; every local worker writes the same."""
    path = os.environ[MOVE_FILE_ENV]
    part = f"{path}.{os.getpid()}"
    with open(part, "w") as f:
        json.dump({"group": target.group, "run_id": target.run_id}, f)
    os.replace(part, path)


def read_move(path: str) -> Target | None:
    try:
        with open(path) as f:
            got = json.load(f)
        return Target(str(got["group"]), str(got["run_id"]))
    except (OSError, ValueError, KeyError):
        return None


def watch_moves() -> None:
    """Make torchrun's agent (this process's) end its run when every failed worker exited with
    :data:`MOVED_EXIT_CODE` and wrote a target: it raises :class:`MovedToPipeline` instead of restarting them."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    monitor = LocalElasticAgent._monitor_workers

    def monitored(self: Any, worker_group: Any) -> Any:
        result = monitor(self, worker_group)
        codes = [f.exitcode for f in result.failures.values()]
        if result.state == WorkerState.FAILED and codes and all(c == MOVED_EXIT_CODE for c in codes):
            target = read_move(os.environ.get(MOVE_FILE_ENV, ""))
            if target is not None:
                raise MovedToPipeline(target)
        return result

    LocalElasticAgent._monitor_workers = monitored  # type: ignore[method-assign]
    # (torch logs every worker that exits with a code as a failure, with a traceback: not one that moves)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_NotAMove())


class _NotAMove(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.args and isinstance(record.args, tuple) and record.args[0] == MOVED_EXIT_CODE)


def relaunch_as(
    target: Target, config: Any, entrypoint: Callable[..., None] | str, args: tuple[Any, ...], why: str = ""
) -> tuple[Callable[..., None] | str, tuple[Any, ...]]:
    """Make this agent a node of pipeline ``target``: its rendezvous id in ``config``, ``REPLICA_GROUP_ID`` in its
    environment; the workers' entry point and arguments (``entrypoint``, ``args``: the agent's own) to launch with
    (``why``: what the line it prints gives as the reason).
    Forked workers take their environment from the fork server, started under the old group: they are given it."""
    from lightning_spot_launch import rendezvous

    why = why or "this node's pipeline could not train on the nodes it has left"
    print(
        f"lightning-spot run: {why}; it joins pipeline {target.group} (rendezvous {target.run_id}), whose survivors "
        f"wait too",
        file=sys.stderr,
        flush=True,
    )
    try:
        os.remove(os.environ.get(MOVE_FILE_ENV, ""))
    except OSError:
        pass
    config.run_id = target.run_id
    os.environ["REPLICA_GROUP_ID"] = target.group
    rendezvous.forget()  # (the rendezvous it left: a later notice leaves the new one only)
    if callable(entrypoint):
        return run_with_env, ({"REPLICA_GROUP_ID": target.group}, entrypoint, *args)
    return entrypoint, args  # (a new interpreter per worker: it takes the agent's environment)


def run_with_env(env: dict[str, str], run: Callable[..., None], *args: Any) -> None:
    """(A forked worker) ``run(*args)`` with ``env`` set first."""
    os.environ.update(env)
    run(*args)
