"""A stage's first layer, called by the user's step on a later pipeline stage (partition/stage_run.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_spot.partition.discovery import ModelContractError
from lightning_spot.partition.stage_run import StageExit, StageRun, instrument_layer, running


class MaskedLinear(nn.Linear):
    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        out = super().forward(x)
        return out if mask is None else out * mask


def _layer() -> nn.Module:
    layer = MaskedLinear(4, 4)
    instrument_layer(layer, "layers.2", stage=1, first=True, last=True)
    return layer


def test_first_layer_takes_the_received_activation() -> None:
    layer, received = _layer(), torch.randn(2, 4)
    run = StageRun(1, first_stage=False, incoming=(received,), exit_after=True)
    with running(run), pytest.raises(StageExit) as stop:
        layer(torch.zeros(2, 4, device="meta"), torch.ones(2, 4))  # the stand-in input is replaced
    torch.testing.assert_close(stop.value.output, nn.Linear.forward(layer, received))


@pytest.mark.parametrize("by_name", [False, True])
def test_an_argument_made_on_another_stage_is_refused_by_name(by_name: bool) -> None:
    layer = _layer()
    meta_mask = torch.ones(2, 4, device="meta")  # what a module of an earlier stage would have computed here
    run = StageRun(1, first_stage=False, incoming=(torch.randn(2, 4),), exit_after=True)
    name = "mask" if by_name else "positional argument 2"
    with running(run), pytest.raises(ModelContractError, match=f"received `{name}` computed by modules that live"):
        if by_name:
            layer(torch.zeros(2, 4), mask=meta_mask)
        else:
            layer(torch.zeros(2, 4), meta_mask)
