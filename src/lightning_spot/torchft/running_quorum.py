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
and how long ago it heartbeated; this module reads that page (``lightning_spot_launch.lighthouse``) before the
pipeline joins (it changes nothing there), and reads the layouts of the quorum it then got (:func:`layouts_in`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from lightning_spot_launch.lighthouse import (
    GONE_SECONDS,
    LAYOUT_TAG,
    LIVE_SECONDS,
    Member,
    RunningQuorum,
    parse_replica_id,
    parse_status,
    read_running,
)

__all__ = [
    "GONE_SECONDS",
    "LIVE_SECONDS",
    "Member",
    "RunningQuorum",
    "describe_layout",
    "layout_tag",
    "layouts_in",
    "layouts_refusal",
    "parse_replica_id",
    "parse_status",
    "parse_tag",
    "read_running",
    "replica_id",
]


def layout_tag(stages: int, cuts: Sequence[int], ranks: int | None = None, style: str = "loop") -> str:
    """The layout a pipeline trains, as its replica id carries it: ``s2c2`` (two stages, cut at layer 2, one per
    process); a looped schedule's stages on fewer processes add their count, and ``v`` for a V-shaped placement:
    ``s4p2c1.2.3``, ``s4p2vc1.2.3``."""
    spread = f"p{ranks}{'v' if style == 'v' else ''}" if ranks is not None and ranks != stages else ""
    return f"s{stages}{spread}c{'.'.join(map(str, cuts))}"


def replica_id(group: str, layout: str) -> str:
    """The pipeline's replica id for torchft (its digits at the end name the group, as torchft expects)."""
    return f"{layout}_pipeline_{group}"


class TagLayout(NamedTuple):
    """What a :func:`layout_tag` says: the stages, the cuts between them, the processes they run on and how the
    stages are placed on them (``loop``: stage ``s`` on process ``s % ranks``; ``v``: there and back)."""

    stages: int
    cuts: list[int]
    ranks: int
    style: str


def parse_tag(tag: str) -> TagLayout | None:
    """The layout of a :func:`layout_tag`; ``None`` for anything else."""
    match = re.fullmatch(LAYOUT_TAG, tag)
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
