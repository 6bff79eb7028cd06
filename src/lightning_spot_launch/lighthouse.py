"""The torchft lighthouse of a spot job: started with timeouts chosen for spot training, and its status page read.

    server = start_lighthouse(port=29510)        # in the coordinator (or a test); server.address()
    running = read_running("http://head:29510", timeout=2.0)   # its latest quorum: each pipeline's step, heartbeats
    server.shutdown()

Heartbeat timeout 1 s: a pipeline whose manager stops heartbeating (killed, or its node gone) leaves the quorum
after a second, and the others commit their next step right after (a live pipeline's managers heartbeat every
0.1 s from a native thread, so only a frozen node misses ten in a row). Join timeout 5 s: how long a quorum
waits for a pipeline that heartbeats but has not asked to join yet (one between steps); one that comes later
joins the next quorum and takes a peer's state.

Here, beside the agent, so that ``lightning-spot coordinator`` starts without importing Lightning (~1.3 s instead
of ~3.2 s on a small machine: a restarted coordinator is back that much sooner). ``lightning_spot.torchft`` reads
the page through :func:`read_running` (``running_quorum``).
"""

from __future__ import annotations

import html
import os
import re
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

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
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's native log: one line per quorum at "info"
    try:
        from torchft.coordination import LighthouseServer
    except ImportError as err:
        raise SystemExit(f"the torchft lighthouse needs torchft: pip install 'lightning-spot[ft]' ({err})") from err

    return LighthouseServer(
        bind=f"[::]:{port}",
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=QUORUM_TICK_MS,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )


#: a member heartbeating less long ago than this is live (torchft's lighthouse gives up on one after 5 s by default)
LIVE_SECONDS = 5.0
#: a member whose managers have not heartbeat for this long has left (they beat every 0.1 s from a native thread,
#: whatever the process does: five beats missed)
GONE_SECONDS = 0.5
#: a layout tag (``running_quorum.layout_tag``), as replica ids carry it
LAYOUT_TAG = r"s(?P<stages>\d+)(?:p(?P<ranks>\d+)(?P<v>v?))?c(?P<cuts>[\d.]*)"
_REPLICA_ID = re.compile(rf"^(?P<tag>{LAYOUT_TAG})_pipeline_(?P<group>[^:]+)")
_MEMBER = re.compile(
    r"<b>(?P<id>[^<]+)</b>.*?Step:\s*(?P<step>\d+).*?World size:\s*(?P<world>\d+)", re.DOTALL
)  # fmt: skip
_HEARTBEAT = re.compile(r"(?P<id>[^\s<>]+):\s*seen\s+(?P<age>[\d.]+)(?P<unit>ms|s|µs|us|ns|m)\s+ago")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}


def parse_replica_id(value: str) -> tuple[str, str] | None:
    """(group, layout tag) of a replica id made by ``running_quorum.replica_id`` (torchft appends ``:uuid``); ``None`` else."""
    match = _REPLICA_ID.match(value)
    if match is None:
        return None
    return match["group"], match["tag"]


@dataclass(frozen=True)
class Member:
    """A pipeline of the lighthouse's latest quorum: its group, layout, step, ranks, and whether it is live."""

    group: str
    layout: str
    step: int
    world_size: int
    live: bool
    #: torchft's replica id (``s2c2_pipeline_1:uuid``): this process group's, a restart of it has another
    replica_id: str = ""


@dataclass(frozen=True)
class RunningQuorum:
    """The members of the lighthouse's latest quorum (made by this project's replica ids), and the age in seconds
    of every replica's last heartbeat."""

    members: tuple[Member, ...]
    heartbeats: dict[str, float] = field(default_factory=dict)

    def others(self, group: str) -> list[Member]:
        """The live members of other replica groups than ``group``."""
        return [m for m in self.members if m.live and m.group != group]

    def latest_step(self, group: str) -> int:
        """The latest step a live pipeline of another group holds (0: none)."""
        return max((m.step for m in self.others(group)), default=0)

    def holders(self, group: str) -> list[str]:
        """The replica ids of the live pipelines of other groups that hold :meth:`latest_step`."""
        latest = self.latest_step(group)
        return [m.replica_id for m in self.others(group) if m.step == latest and latest > 0]

    def stopped(self, replica_ids: Iterable[str], after: float = GONE_SECONDS) -> list[str]:
        """Those of ``replica_ids`` whose heartbeats stopped (the last more than ``after`` s ago; one the page does
        not list is not known to have stopped: a lighthouse that restarted has not heard from it yet)."""
        return [r for r in replica_ids if self.heartbeats.get(r, 0.0) > after]

    def any_live(self, replica_ids: Iterable[str]) -> bool:
        """Whether any of ``replica_ids`` still heartbeats (its last beat less than :data:`LIVE_SECONDS` ago)."""
        return any(self.heartbeats.get(r, LIVE_SECONDS) < LIVE_SECONDS for r in replica_ids)


def parse_status(page: str) -> RunningQuorum:
    """The members of the latest quorum on the lighthouse's ``/status`` page, with their heartbeats' ages."""
    page = html.unescape(page)
    previous = page.split("Previous Quorum", 1)[-1] if "Previous Quorum" in page else ""
    quorum, _, beats = previous.partition("Heartbeats")
    ages = {m["id"]: float(m["age"]) * _UNITS[m["unit"]] for m in _HEARTBEAT.finditer(beats)}
    members = []
    for match in _MEMBER.finditer(quorum):
        parsed = parse_replica_id(match["id"].strip())
        if parsed is None:
            continue
        age = ages.get(match["id"].strip())
        members.append(
            Member(
                group=parsed[0],
                layout=parsed[1],
                step=int(match["step"]),
                world_size=int(match["world"]),
                live=age is not None and age < LIVE_SECONDS,
                replica_id=match["id"].strip(),
            )
        )
    return RunningQuorum(tuple(members), ages)


def read_running(lighthouse: str, timeout: float) -> RunningQuorum | None:
    """The lighthouse's latest quorum, read from its status page (``None``: the page could not be read)."""
    url = (lighthouse if "://" in lighthouse else f"http://{lighthouse}").rstrip("/") + "/status"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return parse_status(response.read().decode("utf-8", errors="replace"))
    except (OSError, ValueError):
        return None
