"""The flattened optimizer state that checkpoints store: after torch's first call, the fast path gives the same
keys, in the same order, with the optimizer's own tensors and values, for several optimizers and models."""

from __future__ import annotations

from collections.abc import Callable
from copy import deepcopy

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from lightning_spot.checkpoint.flat_optimizer import _NAMES, FLAT_OPTIMIZER_STATE, load_optimizer_state, optimizer_state


class Tied(nn.Module):
    """A language-model-like module whose head shares the embedding's weight (one parameter, two names)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.embed(x)))


def _step(module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    module(torch.tensor([[1, 2, 3]])).float().pow(2).mean().backward()
    optimizer.step()


OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
    "adamw-two-groups": lambda m: torch.optim.AdamW(
        [{"params": m.layers.parameters(), "lr": 0.1}, {"params": m.embed.parameters(), "weight_decay": 0.5}]
    ),
    "sgd-momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    "rmsprop": lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01, centered=True),
}


@pytest.mark.parametrize("make", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_the_fast_path_flattens_as_torch_does(
    make: Callable[[nn.Module], torch.optim.Optimizer], monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_spot.checkpoint import flat_optimizer

    calls = []
    monkeypatch.setattr(flat_optimizer, "get_optimizer_state_dict", lambda *a, **k: calls.append(1) or torchs(*a, **k))
    torchs = get_optimizer_state_dict
    torch.manual_seed(0)
    module = Tied()
    optimizer = make(module)
    _step(module, optimizer)
    optimizer_state(module, optimizer)  # torch's call: the names are learned
    assert optimizer in _NAMES and len(calls) == 1
    for _ in range(2):
        _step(module, optimizer)
        optimizer.param_groups[0]["lr"] *= 0.5  # what a scheduler does between saves
        got = optimizer_state(module, optimizer)
        assert len(calls) == 1, "the fast path"
        want = get_optimizer_state_dict(module, optimizer, options=FLAT_OPTIMIZER_STATE)
        assert list(got) == list(want)
        for key, value in want.items():
            if isinstance(value, torch.Tensor):
                assert got[key] is value or got[key].data_ptr() == value.data_ptr(), key
            else:
                assert got[key] == value, key
    assert any(k.startswith("state.embed.weight.") for k in got), "the tied weight under its first name"
    assert not any(k.startswith(("state.head.", "param_groups.head.")) for k in got), "and only there"


def test_new_parameters_or_missing_state_use_torchs_call() -> None:
    module = Tied()
    optimizer = torch.optim.Adam(module.parameters())
    before = optimizer_state(module, optimizer)  # no state yet: torch initialises it (a step with zero gradients)
    assert any(k.startswith("state.") for k in before)
    extra = nn.Parameter(torch.ones(3))
    module.register_parameter("extra", extra)
    optimizer.add_param_group({"params": [extra]})
    got = optimizer_state(module, optimizer)  # the new parameter has no state: torch's call again
    assert got.keys() == get_optimizer_state_dict(module, optimizer, options=FLAT_OPTIMIZER_STATE).keys()
    assert "param_groups.extra.lr" in got


def _flat_from_training(make: Callable[[nn.Module], torch.optim.Optimizer]) -> tuple[nn.Module, dict[str, object]]:
    torch.manual_seed(0)
    source = Tied()
    optimizer = make(source)
    for _ in range(2):
        _step(source, optimizer)
    optimizer.param_groups[0]["lr"] *= 0.5  # a scheduler moved it: the loaded groups must carry it
    return source, optimizer_state(source, optimizer)


def _restored(
    source: nn.Module,
    make: Callable[[nn.Module], torch.optim.Optimizer],
    load: Callable[[nn.Module, torch.optim.Optimizer], None],
    wrap: bool = False,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A fresh module with the source's weights, a fresh optimizer given the state by ``load``, one step on."""
    torch.manual_seed(1)
    module = Tied()
    module.load_state_dict(source.state_dict())
    if wrap:  # names no longer match the stored ones
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        module.layers = checkpoint_wrapper(module.layers)
    optimizer = make(module)
    load(module, optimizer)
    _step(module, optimizer)
    return module, optimizer


@pytest.mark.parametrize("wrap", [False, True], ids=["by-name", "wrapped-torchs-call"])
@pytest.mark.parametrize("make", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_loading_by_name_equals_torchs_load(
    make: Callable[[nn.Module], torch.optim.Optimizer], wrap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_spot.checkpoint import flat_optimizer

    source, flat = _flat_from_training(make)
    theirs = _restored(  # (a load takes the tensors it is given: each load gets copies)
        source,
        make,
        lambda m, o: set_optimizer_state_dict(m, o, deepcopy(flat), options=FLAT_OPTIMIZER_STATE),
        wrap=wrap,
    )
    flat = deepcopy(flat)
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    values = {k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)}
    torchs_load, used = flat_optimizer.set_optimizer_state_dict, []
    monkeypatch.setattr(
        flat_optimizer, "set_optimizer_state_dict", lambda *a, **k: used.append(1) or torchs_load(*a, **k)
    )
    ours = _restored(source, make, lambda m, o: load_optimizer_state(m, o, tensors, values, {}), wrap=wrap)
    assert used == ([1] if wrap else []), "torch's load (its initialising step) only where the names do not match"
    for a, b in zip(theirs[0].parameters(), ours[0].parameters(), strict=True):
        assert torch.equal(a, b)
    want, got = theirs[1].state_dict(), ours[1].state_dict()
    assert want["param_groups"] == got["param_groups"] and got["param_groups"][0]["lr"] != make(Tied()).defaults["lr"]
    assert want["state"].keys() == got["state"].keys()
    for index, state in want["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(got["state"][index][key])), (index, key)


def test_a_tied_weights_second_copy_gets_state_of_its_own() -> None:
    _, flat = _flat_from_training(OPTIMIZERS["adam"])
    copies = Tied()
    copies.head.weight = nn.Parameter(copies.embed.weight.detach().clone())  # the copy a later stage would hold
    optimizer = torch.optim.Adam(copies.parameters())
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    values = {k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)}
    load_optimizer_state(copies, optimizer, tensors, values, {"head.weight": "embed.weight"})
    embed, head = optimizer.state[copies.embed.weight], optimizer.state[copies.head.weight]
    assert torch.equal(embed["exp_avg"], head["exp_avg"]) and embed["exp_avg"] is not head["exp_avg"]
