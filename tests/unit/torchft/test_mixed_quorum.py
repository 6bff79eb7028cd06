"""Pipelines of other cuts in one torchft quorum, in one process: each member's plan from its replica id, and
which of this rank's parameters are reduced with which ranks (a group per holder set, named the same on every
holder)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_spot.layout import LayoutError
from lightning_spot.partition.discovery import ModelSplit
from lightning_spot.torchft.mixed_quorum import HolderReduce, quorum_plans

SPLIT = ModelSplit(
    layers_path="layers", layer_names=("0", "1", "2", "3"), first_modules=("embed",), last_modules=("head",)
)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(2, 2)
        self.layers = nn.Sequential(*(nn.Linear(2, 2) for _ in range(4)))
        self.head = nn.Linear(2, 1)


def test_plans_come_from_the_replica_ids_only_when_the_cuts_differ() -> None:
    alike = ["s2c2_pipeline_0:a", "s2c2_pipeline_1:b"]
    assert quorum_plans(alike, SPLIT) is None, "torchft's own per-stage groups serve pipelines cut alike"
    plans = quorum_plans(["s1c_pipeline_1:a", "s2c2_pipeline_0:b"], SPLIT)
    assert plans is not None and [p.bounds for p in plans] == [(0, 4), (0, 2, 4)]
    assert [p.pp_size for p in plans] == [1, 2]
    assert quorum_plans(["s1c_pipeline_1:a", "not-ours"], SPLIT) is None


def test_each_parameter_goes_to_the_group_of_its_holders() -> None:
    """[1, 2]: the whole pipeline is virtual rank 0, the deep one's stages ranks 1 and 2. The deep one's second
    stage (rank 2) holds layers 2-3 and the head: one group with rank 0, in which it is member 1 of 2."""
    model = _Model()
    plans = quorum_plans(["s1c_pipeline_1:a", "s2c2_pipeline_0:b"], SPLIT)
    assert plans is not None
    made: list[tuple[str, int, int]] = []

    def group(key: str, rank: int, size: int) -> Any:
        made.append((key, rank, size))
        return None

    held = [*model.layers[2].parameters(), *model.layers[3].parameters(), *model.head.parameters()]
    reduce = HolderReduce(model, held, SPLIT, plans, me=(1, 1), pg=group)
    assert made == [("0-2", 1, 2)] and [h for h, _, _ in reduce.groups] == [(0, 2)]
    assert {id(p) for p in reduce.groups[0][1]} == {id(p) for p in held}
    # the whole pipeline's only rank is in both groups, first in each
    made.clear()
    HolderReduce(model, list(model.parameters()), SPLIT, plans, me=(0, 0), pg=group)
    assert made == [("0-1", 0, 2), ("0-2", 0, 2)]
    with pytest.raises(LayoutError, match="tied across stages"):
        HolderReduce(model, held, SPLIT, plans, me=(1, 1), pg=group, tied=[torch.zeros(1)])


def test_alone_in_its_groups_a_rank_keeps_its_gradient_as_the_mean() -> None:
    """One pipeline per holder set (nothing to reduce with): ``.grad`` is its own, the weight its own."""
    model = _Model()
    plans = quorum_plans(["s1c_pipeline_1:a", "s2c2_pipeline_0:b"], SPLIT)
    assert plans is not None
    params = list(model.parameters())
    for p in params:
        p.grad = torch.full_like(p, 3.0)
    reduce = HolderReduce(model, params, SPLIT, plans, me=(0, 0), pg=lambda key, rank, size: None)
    riders = torch.tensor([5.0, 6.0])
    assert reduce.reduce(2.0, riders) == 2.0 and riders.tolist() == [5.0, 6.0]
    assert all(torch.equal(p.grad, torch.full_like(p, 3.0)) for p in params)
