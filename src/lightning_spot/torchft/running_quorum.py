"""The quorum a pipeline is about to join: what the lighthouse's status page says of the pipelines training now.

    running = read_running("http://lighthouse:29510", timeout=5.0)   # None: the page could not be read
    error = layouts_refusal(layouts_in(quorum_ids), layout_tag(2, [2]), "1")  # None, or why it may not train there
    step = running.latest_step(group="1")                             # the step the live pipelines hold
    holders = running.holders(group="1")                              # their replica ids
    read_running(...).any_live(holders)                               # later: still heartbeating?

torchft heals a joining pipeline from the *same stage* of a running one, so every pipeline of a quorum must have
the same stages and cuts; and a pipeline that gets a quorum of its own while others hold a later step would start
the run over beside them. Each pipeline's replica id carries its layout (:func:`replica_id`: ``s2c2_pipeline_1``,
two stages cut at layer 2), which the lighthouse lists on its status page with each member's step and world size
and how long ago it heartbeated; this module reads that page before the pipeline joins (it changes nothing there),
and reads the layouts of the quorum it then got (:func:`layouts_in`).
"""

from __future__ import annotations

import html
import re
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

#: a member heartbeating less long ago than this is live (torchft's lighthouse gives up on one after 5 s by default)
LIVE_SECONDS = 5.0
#: a member whose managers have not heartbeat for this long has left (they beat every 0.1 s; the lighthouse of
#: ``lightning-spot coordinator`` drops one after 1 s)
GONE_SECONDS = 1.5
_TAG = r"s(?P<stages>\d+)(?:p(?P<ranks>\d+)(?P<v>v?))?c(?P<cuts>[\d.]*)"
_REPLICA_ID = re.compile(rf"^(?P<tag>{_TAG})_pipeline_(?P<group>[^:]+)")
_MEMBER = re.compile(
    r"<b>(?P<id>[^<]+)</b>.*?Step:\s*(?P<step>\d+).*?World size:\s*(?P<world>\d+)", re.DOTALL
)  # fmt: skip
_HEARTBEAT = re.compile(r"(?P<id>[^\s<>]+):\s*seen\s+(?P<age>[\d.]+)(?P<unit>ms|s|µs|us|ns|m)\s+ago")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}


def layout_tag(stages: int, cuts: Sequence[int], ranks: int | None = None, style: str = "loop") -> str:
    """The layout a pipeline trains, as its replica id carries it: ``s2c2`` (two stages, cut at layer 2, one per
    process); a looped schedule's stages on fewer processes add their count, and ``v`` for a V-shaped placement:
    ``s4p2c1.2.3``, ``s4p2vc1.2.3``."""
    spread = f"p{ranks}{'v' if style == 'v' else ''}" if ranks is not None and ranks != stages else ""
    return f"s{stages}{spread}c{'.'.join(map(str, cuts))}"


def replica_id(group: str, layout: str) -> str:
    """The pipeline's replica id for torchft (its digits at the end name the group, as torchft expects)."""
    return f"{layout}_pipeline_{group}"


def parse_replica_id(value: str) -> tuple[str, str] | None:
    """(group, layout tag) of a replica id made by :func:`replica_id` (torchft appends ``:uuid``); ``None`` else."""
    match = _REPLICA_ID.match(value)
    if match is None:
        return None
    return match["group"], match["tag"]


class TagLayout(NamedTuple):
    """What a :func:`layout_tag` says: the stages, the cuts between them, the processes they run on and how the
    stages are placed on them (``loop``: stage ``s`` on process ``s % ranks``; ``v``: there and back)."""

    stages: int
    cuts: list[int]
    ranks: int
    style: str


def parse_tag(tag: str) -> TagLayout | None:
    """The layout of a :func:`layout_tag`; ``None`` for anything else."""
    match = re.fullmatch(_TAG, tag)
    if match is None:
        return None
    stages = int(match["stages"])
    ranks = int(match["ranks"]) if match["ranks"] else stages
    return TagLayout(stages, [int(c) for c in match["cuts"].split(".") if c], ranks, "v" if match["v"] else "loop")


def describe_layout(tag: str) -> str:
    """``s2c2`` as a person reads it: ``2 stage(s) cut at layers [2]`` (``... on 1 process(es)`` when fewer)."""
    parsed = parse_tag(tag)
    if parsed is None:
        return tag
    on = f" on {parsed.ranks} process(es)" if parsed.ranks != parsed.stages else ""
    return f"{parsed.stages} stage(s){on}{f' cut at layers {parsed.cuts}' if parsed.cuts else ''}"


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


def layouts_refusal(members: Iterable[tuple[str, str, int | None]], layout: str, group: str) -> str | None:
    """Why pipeline ``group`` training ``layout`` cannot train with ``members`` ((group, layout, step)), or None."""
    other = sorted({(g, lay, step) for g, lay, step in members if g != group and lay != layout}, key=str)
    if not other:
        return None
    theirs = other[0][1]
    parsed = parse_tag(theirs)
    ranks, cuts = (parsed.ranks, parsed.cuts) if parsed is not None else (1, [])
    held = ", ".join(f"pipeline {g}" + (f" at step {s}" if s is not None else "") for g, _, s in other)
    return (
        f"pipeline {group} would train {describe_layout(layout)}, but the running pipelines ({held}) train "
        f"{describe_layout(theirs)}, and the state it took from them does not say which layers it holds (a "
        f"pipeline of another lightning-spot version?), so it cannot be completed rank by rank. Instead: start this "
        f"pipeline with "
        f"their layout (as many nodes or processes as theirs, e.g. `--nnodes {ranks}`, or "
        f"SpotPipelineStrategy(pipeline_stages={ranks}, partition={cuts})) so that it takes a "
        f"peer's state and trains with them; or stop every pipeline and start them all again at one layout: they "
        f"resume from the run's durable checkpoints (SpotCheckpoint), never from step 0."
    )


def layouts_in(replica_ids: Iterable[str]) -> list[tuple[str, str, None]]:
    """(group, layout tag, None) of each replica id of a quorum that carries a layout."""
    parsed = (parse_replica_id(r) for r in replica_ids)
    return [(p[0], p[1], None) for p in parsed if p is not None]


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
