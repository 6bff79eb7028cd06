"""Batch containers that torch's pytree takes for leaves are registered so that micro-batches can be cut."""

from __future__ import annotations

import dataclasses
from collections import UserDict
from collections.abc import Iterator, Mapping

import torch
import torch.utils._pytree as pytree

from lightning_spot.replay.pytree import register_containers
from lightning_spot.runtime.step_runner import batch_size_of


class Encoding(UserDict):
    """Like a tokenizer's BatchEncoding: a UserDict read by key or attribute."""

    def __getattr__(self, name: str) -> torch.Tensor:
        return self.data[name]  # type: ignore[no-any-return]


class FixedKeys(Mapping):
    """A mapping whose constructor does not take a dict: it cannot be rebuilt, so it stays a leaf."""

    def __init__(self, x: torch.Tensor) -> None:
        self._x = x

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._x

    def __iter__(self) -> Iterator[str]:
        return iter(["x"])

    def __len__(self) -> int:
        return 1


@dataclasses.dataclass
class Pair:
    x: torch.Tensor
    extra: Encoding


@dataclasses.dataclass
class WithDerived:
    x: torch.Tensor
    n: int = dataclasses.field(init=False, default=0)


def test_nested_containers_are_walked_and_rebuilt_as_their_types() -> None:
    batch = (Pair(torch.zeros(6, 2), Encoding({"ids": torch.ones(6, 3)})), "meta")
    assert batch_size_of(batch) == 6
    cut = pytree.tree_map(lambda t: t[:2] if isinstance(t, torch.Tensor) else t, batch)
    assert isinstance(cut[0], Pair) and isinstance(cut[0].extra, Encoding) and cut[0].extra.ids.shape == (2, 3)
    assert cut[1] == "meta"


def test_containers_that_cannot_be_rebuilt_stay_leaves() -> None:
    for odd in (FixedKeys(torch.zeros(3)), WithDerived(torch.zeros(3))):
        register_containers(odd)
        assert pytree.tree_flatten(odd)[0] == [odd], type(odd)
