"""``lightning-spot run``: torchrun with the flags and environment that elastic spot training needs.

    lightning-spot run --nproc-per-node 8 train.py --my-arg 1                       # one node
    lightning-spot run --nnodes 1:4 --nproc-per-node 8 --rdzv-endpoint head:29400 train.py

It adds ``--max-restarts`` (preemptions exit with code 75 and are restarted), a c10d rendezvous
(or ``--standalone`` for a fixed single node) whose heartbeat (``--keep-alive``) decides how soon a node that
left or died is given up, a short monitor interval, and
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` so that every restart gets a fresh rendezvous store.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence

ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def torchrun_command(args: argparse.Namespace) -> list[str]:
    """The torchrun command line for the parsed ``lightning-spot run`` arguments."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={args.nproc_per_node}",
        f"--max-restarts={args.max_restarts}",
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
            f"--rdzv-conf=keep_alive_interval={args.keep_alive},keep_alive_max_attempt=3",
        ]
    return [*cmd, args.script, *args.script_args]


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-spot run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nnodes", default="1", help="number of nodes, or MIN:MAX for an elastic job (default 1)")
    parser.add_argument(
        "--nproc-per-node", default="gpu", help="workers per node: a number, 'gpu' or 'cpu' (default gpu)"
    )
    parser.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous (needed for several nodes)")
    parser.add_argument("--rdzv-id", default="lightning-spot", help="job id shared by all nodes")
    parser.add_argument("--max-restarts", type=int, default=100, help="restarts after failures and preemptions")
    parser.add_argument("--monitor-interval", type=float, default=1.0, help="seconds between worker checks")
    parser.add_argument(
        "--keep-alive",
        type=int,
        default=5,
        help="seconds between rendezvous heartbeats; a node that misses 3 is given up (default 5, torchrun's). "
        "A node that left or died holds the others' restart up to 3x this long",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the command and environment, run nothing")
    parser.add_argument("script", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    args = parser.parse_args(list(argv))
    cmd = torchrun_command(args)
    env_text = " ".join(f"{k}={v}" for k, v in ELASTIC_ENV.items())
    print(f"lightning-spot run: {env_text} {shlex.join(cmd)}", flush=True)
    if args.dry_run:
        return 0
    return subprocess.call(cmd, env={**os.environ, **ELASTIC_ENV})
