"""``lightning-spot run``: torchrun's agent with the flags and environment that elastic spot training needs.

    lightning-spot run --nproc-per-node 8 train.py --my-arg 1                       # one node
    lightning-spot run --nnodes 1:4 --nproc-per-node 8 --rdzv-endpoint head:29400 train.py
    lightning-spot run --replica-groups 3 --nproc-per-node 2 train.py          # fault_tolerance="torchft"

It runs torchrun's agent through ``python -m lightning_spot_launch`` (workers forked from a server that has
imported torch and Lightning once; a node stopped by a notice leaves the rendezvous at once) and adds
``--max-restarts`` (preemptions exit with code 75, ranks that lost a peer 69: both are restarted; an error of the
job's code (exit code 1) only ``--max-failures`` times), a c10d rendezvous (or ``--standalone`` for
a fixed single node) whose heartbeat (``--keep-alive``) decides how soon a node that died is given up and whose
``--last-call`` how long a round waits for more nodes, a short monitor interval, and
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` so that every restart gets a fresh rendezvous store.

``--replica-groups N`` (one machine, ``fault_tolerance="torchft"``): an embedded torchft lighthouse and one
torchrun per pipeline (its own rendezvous: a restart of one pipeline never restarts another), each with
``REPLICA_GROUP_ID`` and ``TORCHFT_LIGHTHOUSE`` set. When a pipeline loses a process, its torchrun stops the rest
of it and starts it again; the other pipelines go on training, and the returning one takes a live peer's state.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence

from lightning_spot_launch.agent import DEFAULT_MAX_FAILURES
from lightning_spot_launch.rendezvous import OUTAGE_KEY, OUTAGE_S

ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
#: rendezvous heartbeat: a node that died is given up after 3 missed beats; each beat reads and writes the whole state
#: (~60 bytes per node) at the store: 1 s beats keep it ~1% busy at 64 nodes (7% at 256), beyond 64 torchrun's 5 s
#: (``benchmarks/rendezvous_heartbeat.py``; docs/launch-and-preemption.md)
KEEP_ALIVE_SECONDS = 1
KEEP_ALIVE_MANY_NODES_SECONDS = 5
MANY_NODES = 64
#: how long a rendezvous round waits for more nodes after the last arrival (restarted nodes arrive within ~1 s)
LAST_CALL_SECONDS = 2
DEFAULT_RDZV_ID = "lightning-spot"


def rendezvous_conf(
    keep_alive: int = KEEP_ALIVE_SECONDS, last_call: int = LAST_CALL_SECONDS, coordinator_outage: int | None = None
) -> str:
    """torchrun's ``--rdzv-conf`` value: heartbeats every ``keep_alive`` s (3 missed: given up), rounds that close
    ``last_call`` s after their last arrival; ``coordinator_outage`` (a store that is the coordinator's, hosted by no
    agent): seconds the agents ride through its being unreachable before they exit with code 69."""
    conf = f"keep_alive_interval={keep_alive},keep_alive_max_attempt=3,last_call_timeout={last_call}"
    if coordinator_outage is None:
        return conf
    return f"{conf},is_host=false,{OUTAGE_KEY}={coordinator_outage}"


def apply_coordinator(args: argparse.Namespace, env: dict[str, str]) -> dict[str, str]:
    """``--coordinator HOST[:PORT]``: the rendezvous on its store (each pipeline under its own id when
    ``REPLICA_GROUP_ID`` is set) and, unless ``TORCHFT_LIGHTHOUSE`` is set, its lighthouse; the environment to add."""
    from lightning_spot_launch.coordinator import LIGHTHOUSE_PORT, RDZV_PORT

    host, _, port = args.coordinator.rpartition(":") if ":" in args.coordinator else (args.coordinator, "", "")
    args.rdzv_endpoint = f"{host}:{port or RDZV_PORT}"
    group = env.get("REPLICA_GROUP_ID")
    if group is not None and args.rdzv_id == DEFAULT_RDZV_ID:
        args.rdzv_id = f"{DEFAULT_RDZV_ID}-pipeline-{group}"
    lighthouse = f"http://{host}:{args.lighthouse_port or LIGHTHOUSE_PORT}"
    return {} if "TORCHFT_LIGHTHOUSE" in env else {"TORCHFT_LIGHTHOUSE": lighthouse}


def keep_alive_for(nnodes: str) -> int:
    """The default heartbeat for ``--nnodes`` (``N`` or ``MIN:MAX``): 1 s up to :data:`MANY_NODES` nodes, else 5 s."""
    most = int(nnodes.split(":")[-1]) if nnodes.split(":")[-1].isdigit() else MANY_NODES + 1
    return KEEP_ALIVE_SECONDS if most <= MANY_NODES else KEEP_ALIVE_MANY_NODES_SECONDS


def torchrun_command(args: argparse.Namespace) -> list[str]:
    """The torchrun command line for the parsed ``lightning-spot run`` arguments."""
    cmd = [
        sys.executable,
        "-m",
        "lightning_spot_launch",
        f"--nproc-per-node={args.nproc_per_node}",
        f"--max-restarts={args.max_restarts}",
        f"--max-failures={args.max_failures}",
        f"--monitor-interval={args.monitor_interval}",
    ]
    if args.rdzv_endpoint is None and args.nnodes in ("1", "1:1"):
        cmd.append("--standalone")
    else:
        if args.rdzv_endpoint is None:
            raise SystemExit("lightning-spot run: several nodes need --rdzv-endpoint HOST:PORT (a node that stays up)")
        cmd += [
            f"--nnodes={args.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={args.rdzv_endpoint}",
            f"--rdzv-id={args.rdzv_id}",
            "--rdzv-conf="
            + rendezvous_conf(
                args.keep_alive or keep_alive_for(args.nnodes),
                args.last_call,
                args.coordinator_outage if args.coordinator else None,
            ),
        ]
    if args.shutdown_timeout is not None:
        cmd.append(f"--shutdown-timeout={args.shutdown_timeout}")
    if args.signals_to_handle:
        cmd.append(f"--signals-to-handle={args.signals_to_handle}")
    if args.preload:
        cmd.append(f"--preload={args.preload}")
    if args.fresh_processes:
        cmd.append("--fresh-processes")
    return [*cmd, args.script, *args.script_args]


def _threads_per_process(groups: int, nproc_per_node: str) -> int | None:
    """This machine's cores shared among the processes of all pipelines (torchrun divides them only among its own
    workers, and not at all for one worker: every pipeline's process would take every core, and small operations
    then wait for each other's spinning thread pools); ``None`` where the user set ``OMP_NUM_THREADS``."""
    if "OMP_NUM_THREADS" in os.environ or not nproc_per_node.isdigit():
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // (groups * int(nproc_per_node)))


def run_replica_groups(args: argparse.Namespace, cmd: list[str]) -> int:
    """One torchrun per pipeline beside an embedded lighthouse; the worst exit code of them all."""
    from lightning_spot_launch.lighthouse import start_lighthouse

    lighthouse = start_lighthouse(args.lighthouse_port)
    address = lighthouse.address()
    print(f"lightning-spot run: torchft lighthouse at {address}, {args.replica_groups} pipelines", flush=True)
    procs = []
    threads = _threads_per_process(args.replica_groups, args.nproc_per_node)
    try:
        for group in range(args.replica_groups):
            env = {**os.environ, **ELASTIC_ENV, "TORCHFT_LIGHTHOUSE": address, "REPLICA_GROUP_ID": str(group)}
            if threads is not None:
                env["OMP_NUM_THREADS"] = str(threads)
            procs.append(subprocess.Popen(cmd, env=env))
        while any(p.poll() is None for p in procs):
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            p.wait()
        lighthouse.shutdown()
    codes = [p.returncode for p in procs]
    return max(codes, key=abs) if any(codes) else 0


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-spot run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nnodes", default="1", help="number of nodes, or MIN:MAX for an elastic job (default 1)")
    parser.add_argument(
        "--nproc-per-node", default="gpu", help="workers per node: a number, 'gpu' or 'cpu' (default gpu)"
    )
    parser.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous (needed for several nodes)")
    parser.add_argument("--rdzv-id", default=DEFAULT_RDZV_ID, help="job id shared by all nodes")
    parser.add_argument(
        "--coordinator",
        default=None,
        help="HOST[:PORT] of `lightning-spot coordinator`: the rendezvous on its store (per pipeline with "
        "REPLICA_GROUP_ID) and its torchft lighthouse; replaces --rdzv-endpoint",
    )
    parser.add_argument(
        "--coordinator-outage",
        type=int,
        default=OUTAGE_S,
        help=f"with --coordinator: seconds the agent rides through its being unreachable (a restart under a "
        f"supervisor) before it exits with code 69 for its scheduler to relaunch it (default {OUTAGE_S}); torchft "
        f"pipelines give up on its lighthouse after TorchFT(quorum_timeout) (60 s)",
    )
    parser.add_argument(
        "--max-restarts", type=int, default=100, help="restarts after preemptions, lost peers and killed workers"
    )
    parser.add_argument(
        "--max-failures",
        type=int,
        default=DEFAULT_MAX_FAILURES,
        help="restarts after errors of the job's code (an exception in training_step, a callback...); then it ends",
    )
    parser.add_argument(
        "--monitor-interval",
        type=float,
        default=0.5,
        help="seconds between worker checks: how soon the rest of a pipeline stops after one of its processes died",
    )
    parser.add_argument(
        "--keep-alive",
        type=int,
        default=None,
        help=f"seconds between rendezvous heartbeats; a node that misses 3 is given up, so a node that died holds "
        f"the others' restart up to 3x this long (default {KEEP_ALIVE_SECONDS} up to {MANY_NODES} nodes, "
        f"{KEEP_ALIVE_MANY_NODES_SECONDS} beyond: every beat writes the rendezvous state to its store)",
    )
    parser.add_argument(
        "--last-call",
        type=int,
        default=LAST_CALL_SECONDS,
        help=f"seconds a rendezvous round waits for more nodes after the last one arrived (default "
        f"{LAST_CALL_SECONDS}; torchrun's is 30): part of every restart",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=int,
        default=None,
        help="seconds the agent waits for its workers after forwarding a SIGTERM before it kills them (torchrun's "
        "default 30): more than the coordinated stop's durable save takes, less than the scheduler's grace period",
    )
    parser.add_argument(
        "--signals-to-handle",
        default=None,
        help="signals the agent forwards to its workers (torchrun's default SIGTERM,SIGINT,SIGHUP,SIGQUIT; add SIGUSR1 "
        "for Slurm's --signal=USR1@SECONDS, and give the workers PreemptionWatcher(signals=('SIGTERM', 'SIGUSR1')))",
    )
    parser.add_argument("--preload", default="", help="more modules for the workers' fork server (e.g. transformers)")
    parser.add_argument(
        "--fresh-processes",
        action="store_true",
        help="start every worker as a new interpreter (torchrun's way) instead of forking a preloaded server",
    )
    parser.add_argument(
        "--replica-groups",
        type=int,
        default=None,
        help="one machine, fault_tolerance='torchft': start a lighthouse and this many pipelines, one torchrun each",
    )
    parser.add_argument(
        "--lighthouse-port",
        type=int,
        default=29510,
        help="the embedded lighthouse's port (0: any), or the coordinator's with --coordinator",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the command and environment, run nothing")
    parser.add_argument("script", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    args = parser.parse_args(list(argv))
    if args.replica_groups is not None and (
        args.replica_groups < 1 or args.rdzv_endpoint or args.coordinator or args.nnodes != "1"
    ):
        raise SystemExit(
            "lightning-spot run: --replica-groups N starts N pipelines on this machine; on several machines start "
            "one lightning-spot run per pipeline with REPLICA_GROUP_ID and TORCHFT_LIGHTHOUSE set "
            "(docs/launch-and-preemption.md)"
        )
    extra_env = apply_coordinator(args, dict(os.environ)) if args.coordinator else {}
    cmd = torchrun_command(args)
    if args.replica_groups is not None and not args.dry_run:
        return run_replica_groups(args, cmd)
    env_text = " ".join(f"{k}={v}" for k, v in {**ELASTIC_ENV, **extra_env}.items())
    print(f"lightning-spot run: {env_text} {shlex.join(cmd)}", flush=True)
    if args.dry_run:
        return 0
    # (the agent takes this process's place: a scheduler's SIGTERM reaches it, and its exit code is the job's)
    os.execve(cmd[0], cmd, {**os.environ, **ELASTIC_ENV, **extra_env})
