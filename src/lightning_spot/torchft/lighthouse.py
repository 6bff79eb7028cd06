"""An embedded torchft lighthouse with timeouts chosen for spot training.

    server = start_lighthouse(port=29510)        # in the launcher (or a test); server.address()
    ...
    server.shutdown()

Heartbeat timeout 1 s: a pipeline whose manager stops heartbeating (killed, or its node gone) leaves the quorum
after a second, and the others commit their next step right after (a live pipeline's managers heartbeat every
0.1 s from a native thread, so only a frozen node misses ten in a row). Join timeout 5 s: how long a quorum
waits for a pipeline that heartbeats but has not asked to join yet (one between steps); one that comes later
joins the next quorum and takes a peer's state.
"""

from __future__ import annotations

from typing import Any

from lightning_spot.torchft.config import require_torchft

HEARTBEAT_TIMEOUT_MS = 1000
JOIN_TIMEOUT_MS = 5000
QUORUM_TICK_MS = 50


def start_lighthouse(
    port: int = 0,
    *,
    min_replicas: int = 1,
    heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS,
    join_timeout_ms: int = JOIN_TIMEOUT_MS,
) -> Any:
    """A running ``torchft.coordination.LighthouseServer`` on all interfaces (``port=0``: any free port)."""
    require_torchft()
    from torchft.coordination import LighthouseServer

    return LighthouseServer(
        bind=f"[::]:{port}",
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=QUORUM_TICK_MS,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )
