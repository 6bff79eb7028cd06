"""``lightning-spot coordinator``: the one small process a spot job keeps on a node that stays (on-demand).

    lightning-spot coordinator                            # rendezvous store on :29400, torchft lighthouse on :29510
    lightning-spot coordinator --no-lighthouse            # the restart path only (no fault_tolerance="torchft")

    # then on every spot node (each pipeline its own rendezvous id on the one store):
    REPLICA_GROUP_ID=1 lightning-spot run --coordinator head --nnodes 1:2 --nproc-per-node 8 train.py

It hosts the c10d rendezvous store of every pipeline (one TCPStore, several ``--rdzv-id``; the agents only connect
to it: ``is_host=false``) and, unless told not to, the torchft lighthouse with the spot timeouts of
``lightning_spot_launch/lighthouse.py``. With it no spot node hosts anything the others need: torchrun's c10d rendezvous otherwise
lives in the agent of the node named by ``--rdzv-endpoint``, and the lighthouse in the process that started it.
It logs the lighthouse's membership (pipelines, their steps) as it changes. Stopped by SIGTERM or SIGINT (exit 0);
run it under a supervisor (systemd, a Kubernetes Deployment) that restarts it. It imports torch and torchft, not
Lightning, so that a restart is back in about a second (``python -m lightning_spot_launch.coordinator`` too).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from types import FrameType
from typing import Any, Optional

#: the default ports: torchrun's rendezvous port, and the lighthouse's (as ``lightning-spot run`` uses)
RDZV_PORT = 29400
LIGHTHOUSE_PORT = 29510


class Coordinator:
    """The rendezvous store and the lighthouse, in this process (``start``), until ``stop``."""

    def __init__(self, rdzv_port: int = RDZV_PORT, lighthouse_port: Optional[int] = LIGHTHOUSE_PORT) -> None:
        self.rdzv_port = rdzv_port
        self.lighthouse_port = lighthouse_port
        self.store: Any = None
        self.lighthouse: Any = None

    def start(self) -> Coordinator:
        from torch.distributed import TCPStore

        # (multi-tenant: every pipeline's agents meet on this one store, each rendezvous under its own id)
        self.store = TCPStore(
            "0.0.0.0", self.rdzv_port, is_master=True, multi_tenant=True, wait_for_workers=False,
            timeout=timedelta(seconds=60),
        )  # fmt: skip
        self.rdzv_port = int(self.store.port)
        if self.lighthouse_port is not None:
            from lightning_spot_launch.lighthouse import start_lighthouse

            self.lighthouse = start_lighthouse(self.lighthouse_port)
        return self

    @property
    def lighthouse_address(self) -> Optional[str]:
        return self.lighthouse.address() if self.lighthouse is not None else None

    def membership(self) -> Optional[str]:
        """The lighthouse's latest quorum in one line (``None``: no lighthouse, or its page could not be read)."""
        from lightning_spot_launch.lighthouse import read_running

        address = self.lighthouse_address
        running = read_running(address, timeout=2.0) if address else None
        if running is None:
            return None
        members = sorted(running.members, key=lambda m: m.group)
        live = [f"pipeline {m.group} ({m.layout}, step {m.step})" for m in members if m.live]
        gone = [f"pipeline {m.group}" for m in members if not m.live]
        return f"{len(live)} live: {', '.join(live) or '-'}" + (f"; gone: {', '.join(gone)}" if gone else "")

    def stop(self) -> None:
        if self.lighthouse is not None:
            self.lighthouse.shutdown()
            self.lighthouse = None
        self.store = None  # (the server stops with its last reference)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-spot coordinator", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rdzv-port", type=int, default=RDZV_PORT, help=f"rendezvous store port (default {RDZV_PORT})")
    parser.add_argument(
        "--lighthouse-port",
        type=int,
        default=LIGHTHOUSE_PORT,
        help=f"torchft lighthouse port (default {LIGHTHOUSE_PORT})",
    )
    parser.add_argument("--no-lighthouse", action="store_true", help="no torchft lighthouse (the restart path only)")
    parser.add_argument("--log-every", type=float, default=1.0, help="seconds between membership checks")
    args = parser.parse_args(list(argv))
    coordinator = Coordinator(args.rdzv_port, None if args.no_lighthouse else args.lighthouse_port).start()
    stopped = threading.Event()

    def stop(signum: int, frame: Optional[FrameType]) -> None:
        stopped.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop)
    print(
        f"lightning-spot coordinator: rendezvous store on port {coordinator.rdzv_port}"
        + (f", torchft lighthouse at {coordinator.lighthouse_address}" if coordinator.lighthouse else "")
        + f"; nodes: lightning-spot run --coordinator HOST:{coordinator.rdzv_port} ...",
        flush=True,
    )
    last = None
    try:
        while not stopped.wait(args.log_every):
            seen = coordinator.membership()
            if seen is not None and seen != last:
                print(f"lightning-spot coordinator: {time.strftime('%H:%M:%S')} {seen}", flush=True)
                last = seen
    finally:
        coordinator.stop()
    print("lightning-spot coordinator: stopped", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
