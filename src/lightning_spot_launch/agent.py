"""torchrun's agent with spot-ready restarts: forked workers and a clean leave (see the package docstring).

    python -m lightning_spot_launch --nnodes 1:4 --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint head:29400 train.py --my-arg 1

Takes torchrun's flags, plus ``--preload MODULES`` (more modules for the fork server, e.g. ``transformers``),
``--max-failures N`` (restarts after errors of the job's code, see ``failures``; preemptions, lost peers and kills
are restarted up to ``--max-restarts``) and ``--fresh-processes`` (start every worker as a new interpreter, as
torchrun does).

A node whose workers exit with ``MOVED_EXIT_CODE`` joins the pipeline they named instead (``moves``): the agent runs
again as that pipeline's node.

Its own exit code, for the scheduler that runs it: 0 when training ended, 75 when a notice (SIGTERM) stopped it,
69 or 75 when its restarts are spent on lost peers or preemptions, 69 when the rendezvous failed (its store, the
coordinator, unreachable for longer than ``outage_timeout``; no peer within ``join_timeout``), 1 for an error of the
job's code.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable, Sequence

from lightning_spot_launch import AGENT_PID_ENV, FAILED_EXIT_CODE, PEER_LOST_EXIT_CODE, PREEMPTED_EXIT_CODE, rendezvous
from lightning_spot_launch.failures import agent_exit_code, limit_error_restarts, mark_restarts
from lightning_spot_launch.forked import forked_entrypoint
from lightning_spot_launch.moves import MovedToPipeline, relaunch_as, watch_moves, worker_env
from lightning_spot_launch.waiting import returning_node_target

#: an error of the job's code is run again this many times (a transient one may pass), then ends the job
DEFAULT_MAX_FAILURES = 2


def main(argv: Sequence[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    parser = get_args_parser()
    parser.add_argument(
        "--preload", default="", help="comma-separated modules the fork server imports too (e.g. transformers)"
    )
    parser.add_argument(
        "--max-failures",
        type=int,
        default=DEFAULT_MAX_FAILURES,
        help="restarts after errors of the job's code (preemptions, lost peers and kills: up to --max-restarts)",
    )
    parser.add_argument(
        "--fresh-processes",
        action="store_true",
        help="start every worker as a new interpreter (torchrun's way) instead of forking the preloaded server",
    )
    args = parser.parse_args(list(argv))
    if args.standalone:  # as torchrun: a rendezvous of its own on this machine
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    forked = not (args.fresh_processes or args.no_python or args.run_path)
    user_threads = "OMP_NUM_THREADS" in os.environ
    config, cmd, cmd_args = config_from_args(args)
    if not user_threads:  # torchrun's OMP_NUM_THREADS=1 default: lightning_spot sizes every rank's pool itself
        os.environ.pop("OMP_NUM_THREADS", None)
    if config.rdzv_backend == "c10d":
        config.rdzv_backend = rendezvous.register()
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    os.environ.update(worker_env(config, os.getpid()))
    limit_error_restarts(args.max_failures)
    mark_restarts()
    watch_moves()
    entrypoint: Callable[..., None] | str
    if forked:
        extra = [m for m in args.preload.split(",") if m]
        config.start_method = "forkserver"
        entrypoint, call_args = forked_entrypoint(
            args.training_script, args.training_script_args, module=args.module, extra=extra
        )
    else:
        entrypoint, call_args = cmd, tuple(cmd_args)

    @record
    def launch() -> int:
        how = (entrypoint, call_args)
        elsewhere = returning_node_target(config)  # (its pipeline full, its place taken by a moved node)
        if elsewhere is not None:
            full = f"pipeline {os.environ.get('REPLICA_GROUP_ID', '?')} is full (a moved node took this node's place)"
            how = relaunch_as(elsewhere, config, entrypoint, call_args, why=full)
        try:
            while True:
                try:
                    elastic_launch(config, how[0])(*how[1])
                    return 0
                except MovedToPipeline as moved:  # (its workers stopped, its rendezvous left): a node of another
                    how = relaunch_as(moved.target, config, entrypoint, call_args)
        except SignalException as notice:
            rendezvous.leave()  # stopped by a notice: the others need not wait for this node's keep-alive
            print(
                f"lightning-spot run: stopped by {notice.sigval.name}: exit code {PREEMPTED_EXIT_CODE}", file=sys.stderr
            )
            return PREEMPTED_EXIT_CODE
        except (RendezvousConnectionError, RendezvousTimeoutError) as lost:  # the coordinator is gone, or no peer came
            print(
                f"lightning-spot run: the rendezvous failed ({type(lost).__name__}: {lost}): exit code "
                f"{PEER_LOST_EXIT_CODE}. Relaunched once the rendezvous host (the coordinator) is back, the job resumes "
                f"from its durable checkpoints.",
                file=sys.stderr,
            )
            return PEER_LOST_EXIT_CODE
        except ChildFailedError as failed:  # (restarts spent) a scheduler recovers 75 and 69, fails the job on 1
            code = agent_exit_code(f.exitcode for f in failed.failures.values())
            if code == FAILED_EXIT_CODE:
                raise
            print(f"lightning-spot run: restarts spent ({failed.failures}): exit code {code}", file=sys.stderr)
            return code

    return launch() or 0
