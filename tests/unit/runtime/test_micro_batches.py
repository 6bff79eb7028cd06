"""Taking a micro-batch's rows of a batch (runtime/step_runner.py): the same structure tree_map would give."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_map

from lightning_spot.runtime.step_runner import _map_leaves

Pair = collections.namedtuple("Pair", "x y")


def _double(t: Any) -> Any:
    return t * 2 if isinstance(t, torch.Tensor) else t


@pytest.mark.parametrize(
    "batch",
    [
        torch.ones(2),
        (torch.ones(2), torch.zeros(2)),
        [torch.ones(1), 3, None, "text"],
        {"input_ids": torch.ones(2), "nested": [torch.ones(1), {"labels": torch.full((1,), -100.0)}]},
        Pair(torch.ones(1), 2),
        collections.OrderedDict(a=torch.ones(1), b=(torch.zeros(1),)),
        5,
    ],
    ids=["tensor", "tuple", "list", "dict", "namedtuple", "ordereddict", "leaf"],
)
def test_map_leaves_is_tree_map(batch: Any) -> None:
    expected, got = tree_map(_double, batch), _map_leaves(_double, batch)
    assert type(got) is type(expected)
    assert str(got) == str(expected)
