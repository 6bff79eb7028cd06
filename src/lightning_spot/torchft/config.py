"""What a fault-tolerant job needs to know: the lighthouse, this pipeline's replica-group id, timeouts."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, replace
from typing import Optional, Union
from urllib.parse import urlparse

from lightning_spot.layout import LayoutError

#: environment variables read when the arguments leave them out (the first is torchft's own)
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
REPLICA_GROUP_ENV = "REPLICA_GROUP_ID"
INSTALL_HINT = "pip install 'lightning-spot[ft]'"


@dataclass(frozen=True)
class TorchFT:
    """Settings of the torchft mode (``SpotPipelineStrategy(fault_tolerance=TorchFT(...))``).

    Args:
        lighthouse: the lighthouse's address (``http://host:29510``); default ``$TORCHFT_LIGHTHOUSE``.
        replica_group: this pipeline's id, the same on all its ranks and distinct per pipeline (``"0"``,
            ``"1"``, ...); default ``$REPLICA_GROUP_ID``.
        min_replicas: fewest pipelines a step may commit with.
        timeout: seconds a gradient all-reduce or a commit vote may take before the step is given up (and run
            again with the pipelines that are left).
        quorum_timeout: seconds a step waits for the lighthouse to form a quorum before the job fails.
        connect_timeout: seconds to reach the lighthouse and the peers' managers. torchft's reconnects back off
            (x1.5 from 0.1 s) up to it before starting over: 3 s keeps a restarted lighthouse's heartbeats within
            about a second (10 s left gaps of 2-3 s, longer than its 1 s heartbeat timeout).
        quorum_retries: how many times a quorum the lighthouse did not answer is asked again within
            ``quorum_timeout`` (evenly spaced): a lighthouse that restarts (a coordinator under a supervisor) within
            it loses no pipeline. 0: the first failure ends the job, after ``quorum_timeout``.
        overlap: send each gradient bucket to the other pipelines during the backward, as soon as it is final
            (faster steps), instead of after it. Off by default: in about one run in fifteen of the survivors
            test with it on, a pipeline lost while a bucket was in flight held the others until ``timeout``
            instead of ~1 s; the cause is not found (over gloo a survivor is told of a killed peer within
            milliseconds: ``benchmarks/gloo_peer_loss.py``).
    """

    lighthouse: Optional[str] = None
    replica_group: Optional[str] = None
    min_replicas: int = 1
    timeout: float = 30.0
    quorum_timeout: float = 60.0
    connect_timeout: float = 3.0
    quorum_retries: int = 20
    overlap: bool = False

    def resolved(self) -> TorchFT:
        """These settings with the environment filled in; an error names what is missing and how to give it."""
        lighthouse = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if not lighthouse:
            raise LayoutError(
                f"fault_tolerance='torchft' needs the lighthouse's address: set {LIGHTHOUSE_ENV}=http://HOST:PORT "
                f"(start one with `torchft_lighthouse --min_replicas 1`, or let `lightning-spot run --replica-groups N` "
                f"start it), or pass TorchFT(lighthouse=...)."
            )
        group = self.replica_group if self.replica_group is not None else os.environ.get(REPLICA_GROUP_ENV)
        if group is None or group == "":
            raise LayoutError(
                f"fault_tolerance='torchft' needs this pipeline's replica-group id: set {REPLICA_GROUP_ENV}=0, 1, ... "
                f"(one per torchrun, the same on all ranks of a pipeline) or pass TorchFT(replica_group=...)."
            )
        if self.min_replicas < 1:
            raise LayoutError(f"TorchFT(min_replicas={self.min_replicas}): at least 1")
        return replace(self, lighthouse=lighthouse, replica_group=str(group))


def resolve_fault_tolerance(value: Union[str, TorchFT, None]) -> Optional[TorchFT]:
    """The strategy's ``fault_tolerance`` argument as settings (``None``: off)."""
    if value is None or value is False:
        return None
    if isinstance(value, TorchFT):
        return value
    if value == "torchft":
        return TorchFT()
    raise LayoutError(f"fault_tolerance must be None, 'torchft' or TorchFT(...), got {value!r}")


def require_torchft() -> None:
    """Fail with the install command when the optional dependency is missing."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's native log: one line per quorum and commit at "info"
    try:
        import torchft  # noqa: F401
    except ImportError as err:
        raise LayoutError(f"fault_tolerance='torchft' needs torchft: {INSTALL_HINT} ({err})") from err


def check_reachable(address: str, timeout: float) -> None:
    """Fail at start, naming the address and the fix, when nothing listens at the lighthouse's address."""
    parsed = urlparse(address if "://" in address else f"http://{address}")
    host, port = parsed.hostname, parsed.port
    if not host or not port:
        raise LayoutError(f"the lighthouse address {address!r} has no host:port (expected http://HOST:PORT)")
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return
    except OSError as err:
        raise LayoutError(
            f"cannot reach the torchft lighthouse at {address} ({err}). Start it on a node that is not "
            f"preemptible (`torchft_lighthouse --min_replicas 1 --bind [::]:{port}`) and point {LIGHTHOUSE_ENV} at "
            f"it, or launch with `lightning-spot run --replica-groups N`, which starts one."
        ) from err
