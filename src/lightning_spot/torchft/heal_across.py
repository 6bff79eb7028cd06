"""A joining pipeline takes its state from a peer that cuts the model differently: layer ranges from several ranks.

    ranks = source_ranks(names, split, "s2c2")          # the peer's ranks holding what this rank needs
    first = heal_source_rank(2, names, split, "s2c2")    # where torchft heals rank 2 from (a deeper joiner's)
    state = merged(own, [fetch(r) for r in others])     # one stage state over the layers this rank now holds

torchft heals stage ``k`` of a joiner from stage ``k`` of a live peer. When the peer is cut otherwise (a pipeline
re-formed at a smaller depth joins deeper ones), that stage holds only part of this rank's layers: the rest is
fetched from the peer's other ranks; a joiner deeper than the peer has ranks with no counterpart there, and torchft
is pointed at the peer's first rank holding their layers instead (``heal_source_rank``). The other ranks' states are
fetched which serve their state at the same step (every rank of the peer got the
joiner in its quorum), through torchft's own checkpoint transport. Tensors are merged by their stored names, and so
are the optimizer's other values; random state and Lightning's loops come from the stage torchft healed from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from lightning_spot.checkpoint.jsonstate import decode, encode
from lightning_spot.partition.discovery import ModelSplit
from lightning_spot.partition.placement import stage_of_parameter
from lightning_spot.torchft.mixed_quorum import plan_of


def source_ranks(names: Iterable[str], split: ModelSplit, layout: str) -> set[int]:
    """The ranks of a pipeline training ``layout`` (a layout tag) that hold the parameters and buffers ``names``."""
    plan = plan_of(layout, split)
    if plan is None:
        raise ValueError(f"cannot read the layout {layout!r} of the pipeline a joiner heals from")
    ranks = set()
    for name in names:
        stage = stage_of_parameter(name, split, plan)
        if stage is not None:
            ranks.add(plan.rank_of_stage(stage))
    return ranks


def heal_source_rank(rank: int, names: Iterable[str], split: ModelSplit, layout: str) -> int:
    """The rank of a peer training ``layout`` that torchft should heal rank ``rank`` (holding ``names``) from: the
    same rank where the peer has it (torchft's rule), else the peer's first rank holding any of ``names`` (a joiner
    deeper than the peer: its last ranks have no counterpart there)."""
    plan = plan_of(layout, split)
    if plan is None or rank < plan.pp_size:
        return rank
    holders = source_ranks(names, split, layout)
    return min(holders) if holders else 0


def serves_unassigned(result: Any) -> bool:
    """Whether this rank, in quorum ``result`` (torchft's ``QuorumResult``; its pipelines cut the model otherwise),
    serves its state to joiners torchft did not assign to it. torchft assigns each joiner a source per stage rank,
    round-robin over the peers at the newest step starting at the stage's rank (``(i + rank) % peers``): with three
    pipelines or more, rank 1 of the peer a joiner heals rank 0 from is another peer's source, and serves nothing.
    A joiner cut otherwise fetches every rank it needs from its own source, so every rank at the newest step serves
    while a pipeline is behind (with ``init_sync=False`` those are the members not at the newest step)."""
    if getattr(result, "heal", False) or getattr(result, "recover_dst_replica_ranks", None):
        return False  # (healing itself, or torchft serves this rank's state anyway)
    behind = int(getattr(result, "replica_world_size", 0)) - int(getattr(result, "max_world_size", 0))
    return getattr(result, "max_replica_rank", None) is not None and behind > 0


def merged(own: dict[str, Any], others: list[dict[str, Any]]) -> dict[str, Any]:
    """One stage state (``heal.stage_state``'s) of ``own`` with the tensors and optimizer values of ``others``
    added under their stored names; random state and Lightning's part stay ``own``'s."""
    tensors = {group: dict(named) for group, named in own["tensors"].items()}
    values = [decode(v) for v in own["optimizer_values"]]
    for other in others:
        for group, named in other["tensors"].items():
            tensors.setdefault(group, {}).update({k: v for k, v in named.items() if k not in tensors[group]})
        for i, v in enumerate(other["optimizer_values"]):
            values[i] = {**decode(v), **values[i]}
    return {**own, "tensors": tensors, "optimizer_values": [encode(v, f"optimizer_{i}") for i, v in enumerate(values)]}


def healed_across(
    state: dict[str, Any],
    *,
    layout: str,
    rank: int,
    names: Iterable[str],
    split: ModelSplit,
    fetch: Callable[[int], Any],
) -> dict[str, Any]:
    """``state`` (what torchft healed this rank with, from rank ``rank`` of a peer) completed with what the peer's
    other ranks hold of ``names`` when the peer trains another ``layout`` than this pipeline."""
    source = state.get("layout")
    if source is None or source == layout:
        return state
    wanted = source_ranks(names, split, source) - {rank}
    others = [fetch(r)["stage"] for r in sorted(wanted)]
    return {**state, "stage": merged(state["stage"], others), "layout": layout}
