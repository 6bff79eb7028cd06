"""Pipelines of other cuts in one torchft quorum, in one process: each member's plan from its replica id, and
which of this rank's parameters are reduced with which ranks (a group per holder set, named the same on every
holder)."""

from __future__ import annotations

import threading
import types
from typing import Any

import torch
from torch import nn

from lightning_spot.partition.discovery import ModelSplit
from lightning_spot.partition.placement import TiedParameter
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


def test_a_looped_pipeline_reduces_each_of_its_stages_with_their_holders() -> None:
    """[4 stages on 2 processes, 1]: the looped pipeline's first process runs stages 0 and 2 (the embedding with
    layer 0, and layer 2), its second stages 1 and 3; each reduces everything it holds with the whole pipeline's
    rank (virtual rank 2)."""
    model = _Model()
    plans = quorum_plans(["s4p2c1.2.3_pipeline_0:a", "s1c_pipeline_1:b"], SPLIT)
    assert plans is not None and [(p.pp_size, p.num_stages) for p in plans] == [(2, 4), (1, 1)]
    made: list[tuple[str, int, int]] = []

    def group(key: str, rank: int, size: int) -> Any:
        made.append((key, rank, size))
        return None

    first = [*model.embed.parameters(), *model.layers[0].parameters(), *model.layers[2].parameters()]
    reduce = HolderReduce(model, first, SPLIT, plans, me=(0, 0), pg=group)
    assert made == [("0-2", 0, 2)] and {id(p) for p in reduce.groups[0][1]} == {id(p) for p in first}
    made.clear()
    HolderReduce(model, list(model.parameters()), SPLIT, plans, me=(1, 0), pg=group)
    assert made == [("0-2", 1, 2), ("1-2", 1, 2)]


class _TiedModel(nn.Module):
    """The embedding's weight shared with the head (as GPT-2's wte and lm_head), on the stages a rank holds."""

    def __init__(self, first: bool, last: bool) -> None:
        super().__init__()
        weight = nn.Parameter(torch.zeros(2, 2))
        if first:
            self.embed = nn.Linear(2, 2, bias=False)
            self.embed.weight = weight
        self.layers = nn.Sequential(*(nn.Linear(2, 2) for _ in range(4)))
        if last:
            self.head = nn.Linear(2, 2, bias=False)
            self.head.weight = weight


class _SummingGroups:
    """Process groups of threads: an all-reduce sums what the group's members send (each group by its key)."""

    def __init__(self) -> None:
        self.sent: dict[str, list[torch.Tensor]] = {}
        self.barriers: dict[str, threading.Barrier] = {}
        self.lock = threading.Lock()

    def __call__(self, key: str, rank: int, size: int) -> Any:
        with self.lock:
            self.barriers.setdefault(key, threading.Barrier(size))
            self.sent.setdefault(key, [])
        outer = self

        class _Group:
            def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
                flat = tensors[0]
                with outer.lock:
                    outer.sent[key].append(flat.clone())
                outer.barriers[key].wait(timeout=10)
                total = torch.stack(outer.sent[key]).sum(0)
                outer.barriers[key].wait(timeout=10)
                flat.copy_(total)
                return types.SimpleNamespace(wait=lambda: None)

        return _Group()


def test_a_tied_weight_is_averaged_over_every_copy_counting_each_pipeline_once() -> None:
    """[2, 1] with the embedding tied to the head: pipeline 0's two stages each hold a copy (their gradients already
    summed to the pipeline's, 3 on both), pipeline 1's one rank holds it once (gradient 6). With weights 1 and 2 every
    copy gets (1 x 3 + 2 x 6) / 3 = 5: pipeline 0's gradient counted once, not once per copy."""
    tie = TiedParameter("embed.weight", {"embed.weight": 0, "head.weight": 1})
    plans = quorum_plans(["s2c2_pipeline_0:a", "s1c_pipeline_1:b"], SPLIT)
    assert plans is not None
    ranks = {(0, 0): _TiedModel(True, False), (0, 1): _TiedModel(False, True), (1, 0): _TiedModel(True, True)}
    grads, weights = {(0, 0): 3.0, (0, 1): 3.0, (1, 0): 6.0}, {0: 1.0, 1: 2.0}
    groups, reduces = _SummingGroups(), {}
    held = {(0, 0): ("embed.", "layers.0.", "layers.1."), (0, 1): ("layers.2.", "layers.3.", "head.")}
    for me, model in ranks.items():
        params = [p for n, p in model.named_parameters() if n.startswith(held.get(me, ("",)))]
        for p in params:
            p.grad = torch.full_like(p, grads[me])
        reduces[me] = HolderReduce(model, params, SPLIT, plans, me=me, pg=groups, ties=[tie])
    assert [h for h, _, _ in reduces[(1, 0)].tie_groups] == [(0, 1, 2)], "one group of the three copies"
    assert all(h != (0, 1, 2) for r in reduces.values() for h, _, _ in r.groups), "the tie is not reduced twice"
    summed: dict[tuple[int, int], float] = {}
    threads = [
        threading.Thread(target=lambda me=me: summed.__setitem__(me, reduces[me].reduce(weights[me[0]])))
        for me in ranks
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert summed == dict.fromkeys(ranks, 3.0)
    for me, model in ranks.items():
        tied = [p for n, p in model.named_parameters() if n in ("embed.weight", "head.weight")]
        assert tied and all(torch.equal(p.grad, torch.full_like(p, 5.0)) for p in tied), me
    # the layers are averaged with their holders alone: layer 0 between (0, 0) and (1, 0), weighted 1 and 2
    assert torch.equal(ranks[(0, 0)].layers[0].weight.grad, torch.full((2, 2), 5.0))


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
