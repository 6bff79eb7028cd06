"""A joiner's state from a peer cut otherwise, in one process: which of the peer's ranks hold this rank's names, and
the merge of their stage states by stored names."""

from __future__ import annotations

from typing import Any

import torch

from lightning_spot.checkpoint.jsonstate import decode, encode
from lightning_spot.partition.discovery import ModelSplit
from lightning_spot.torchft.heal_across import healed_across, source_ranks

SPLIT = ModelSplit(
    layers_path="layers", layer_names=("0", "1", "2", "3"), first_modules=("embed",), last_modules=("head",)
)
WHOLE = ["embed.weight", "layers.0.weight", "layers.1.weight", "layers.2.weight", "layers.3.weight", "head.weight"]


def _stage(names: list[str], rng: str) -> dict[str, Any]:
    return {
        "tensors": {"model": {n: torch.full((1,), float(i)) for i, n in enumerate(names)}, "optimizer_0": {}},
        "optimizer_values": [encode({f"state.{n}.step": 3 for n in names} | {"param_groups.0.lr": 0.1})],
        "rng": rng,
        "lightning": {"loops": "from rank 0"},
    }


def test_a_whole_stage_needs_every_rank_of_a_pipeline_cut_in_two() -> None:
    assert source_ranks(WHOLE, SPLIT, "s2c2") == {0, 1}
    assert source_ranks(WHOLE[:3], SPLIT, "s2c2") == {0}
    assert source_ranks(WHOLE, SPLIT, "s1c") == {0}


def test_a_joiner_at_depth_one_gets_the_other_half_from_the_peer_s_second_rank() -> None:
    fetched: list[int] = []

    def fetch(rank: int) -> dict[str, Any]:
        fetched.append(rank)
        return {"stage": _stage(WHOLE[3:], "theirs"), "layout": "s2c2"}

    own = {"stage": _stage(WHOLE[:3], "ours"), "samples_seen": 96, "layout": "s2c2"}
    got = healed_across(own, layout="s1c", rank=0, names=WHOLE, split=SPLIT, fetch=fetch)
    assert fetched == [1] and got["layout"] == "s1c" and got["samples_seen"] == 96
    assert sorted(got["stage"]["tensors"]["model"]) == sorted(WHOLE)
    assert got["stage"]["rng"] == "ours" and got["stage"]["lightning"] == {"loops": "from rank 0"}
    values = decode(got["stage"]["optimizer_values"][0])
    assert {k for k in values if k.endswith(".step")} == {f"state.{n}.step" for n in WHOLE}
    same = {"stage": _stage(WHOLE, "ours"), "layout": "s1c"}
    assert healed_across(same, layout="s1c", rank=0, names=WHOLE, split=SPLIT, fetch=fetch) is same and fetched == [1]


def test_a_deeper_joiner_s_ranks_that_the_peer_lacks_heal_from_its_first_rank_holding_their_layers() -> None:
    from lightning_spot.torchft.heal_across import heal_source_rank

    assert heal_source_rank(0, WHOLE[:3], SPLIT, "s1c") == 0  # (torchft's own rule: the same rank)
    assert heal_source_rank(1, WHOLE[3:], SPLIT, "s1c") == 0  # (the peer has no rank 1: its only rank holds all)
    assert heal_source_rank(3, WHOLE[4:], SPLIT, "s2c2") == 1  # (a joiner of 4 stages, a peer of 2)
    assert heal_source_rank(1, WHOLE[3:], SPLIT, "s2c2") == 1  # (the peer has rank 1: torchft's rule)
