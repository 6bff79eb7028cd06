"""Placement keeps exactly one rank's stages, under their original names (no processes needed)."""

from __future__ import annotations

import pytest
import torch

from lightning_spot import ModelContractError, discover, plan_stages
from lightning_spot.partition.placement import place_stages
from lightning_spot.partition.stage_run import RemoteModule, SkippedLayer, StageRun, running
from tests.models import make_model


def _place(pp_rank: int, pp_size: int = 2, model=None):
    model = model or make_model()
    split = discover(model)
    placed = place_stages(
        model, split, plan_stages(split.num_layers, pp_size), pp_rank=pp_rank, device=torch.device("cpu")
    )
    return model, placed


def test_each_rank_keeps_only_its_stage_under_original_names() -> None:
    first, _ = _place(0)
    last, _ = _place(1)
    assert sorted(first.state_dict()) == sorted(
        [
            "embed.weight",
            "embed.bias",
            "layers.0.fc.weight",
            "layers.0.fc.bias",
            "layers.1.fc.weight",
            "layers.1.fc.bias",
        ]
    )
    assert sorted(last.state_dict()) == sorted(
        ["layers.2.fc.weight", "layers.2.fc.bias", "layers.3.fc.weight", "layers.3.fc.bias", "head.weight", "head.bias"]
    )
    assert isinstance(first.head, RemoteModule) and isinstance(first.layers[3], SkippedLayer)
    assert isinstance(last.embed, RemoteModule) and len(last.layers) == 4
    full = make_model().state_dict()
    for model in (first, last):
        for k, v in model.state_dict().items():
            assert torch.equal(v, full[k]), "eagerly built weights are kept as they are"


def test_placing_again_reuses_or_refuses() -> None:
    model, placed = _place(1)
    split = discover(model)
    assert place_stages(model, split, plan_stages(4, 2), pp_rank=1, device=torch.device("cpu")) is placed
    with pytest.raises(ModelContractError, match="already split into pipeline stages"):
        place_stages(model, split, plan_stages(4, 4), pp_rank=1, device=torch.device("cpu"))


def test_later_stage_receives_the_activation_and_rejects_meta_arguments() -> None:
    model, _ = _place(1)
    incoming = torch.randn(3, 16)
    x = torch.randn(3, 6)
    with running(StageRun(stage=1, first_stage=False, incoming=(incoming,), exit_after=False)):
        out = model(x)  # embed runs on meta; layers 2-3 start from `incoming`
    expected = model.head(model.layers[3](model.layers[2](incoming)))
    torch.testing.assert_close(out, expected)

    class MaskedBlock(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.inner(h) * mask

    from lightning_spot.partition.stage_run import instrument_layer

    layer = MaskedBlock(torch.nn.Linear(16, 16))
    instrument_layer(layer, "layers.2", 1, first=True, last=True)
    run = StageRun(stage=1, first_stage=False, incoming=(incoming,), exit_after=False)
    with (
        running(run),
        pytest.raises(
            ModelContractError, match="received `positional argument 2` computed by modules that live on another"
        ),
    ):
        layer(torch.empty(3, 16, device="meta"), torch.ones(3, 16, device="meta"))


def test_meta_module_without_reset_parameters_is_named() -> None:
    class Scale(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = torch.nn.Parameter(torch.ones(16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.gain

    with torch.device("meta"):
        model = make_model()
        model.layers[0] = Scale()
    with pytest.raises(
        ModelContractError,
        match=r"Module `layers.0` \(Scale\) was created on the meta device but defines no `reset_parameters",
    ):
        _place(0, model=model)
