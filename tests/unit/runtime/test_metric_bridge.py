"""The torchmetrics bridge's pieces that need no processes: a micro-batch's value that cannot be computed, and a
metric built on the meta device."""

from __future__ import annotations

import pytest
import torch
import torchmetrics
from torch import nn

from lightning_spot import ModelContractError
from lightning_spot.partition.stage_run import StageRun, running
from lightning_spot.runtime import metric_bridge
from lightning_spot.runtime.metric_bridge import refuse_meta_states, share_computes


def test_a_metric_called_on_a_micro_batch_it_cannot_compute_gives_nan_and_keeps_its_states() -> None:
    """R^2 of one sample raises in torchmetrics; inside a stage's run of the step (micro-batches of one sample from a
    short last batch) the call returns NaN with one warning, and the sample still counts in the metric's states."""
    metric = torchmetrics.R2Score()
    share_computes(metric, holds_last=True, share=lambda value: value)
    metric_bridge._UNCOMPUTABLE.clear()
    run = StageRun(0, first_stage=True, incoming=None, exit_after=False, device=torch.device("cpu"))
    with running(run), pytest.warns(UserWarning, match="R2Score cannot be computed on one micro-batch") as seen:
        values = [metric(torch.tensor([float(i)]), torch.tensor([2.0 * i])) for i in range(3)]
    assert len(seen) == 1 and all(torch.isnan(v) for v in values)
    want = torchmetrics.functional.r2_score(torch.arange(3.0), 2.0 * torch.arange(3.0))
    assert torch.allclose(metric.compute(), want), "every call's sample is in the epoch's value"
    with pytest.raises(ValueError, match="at least two samples"):  # outside a step: torchmetrics' own error
        torchmetrics.R2Score()(torch.tensor([1.0]), torch.tensor([1.0]))


def test_inputs_a_metric_cannot_take_raise_inside_a_step_too() -> None:
    """Only a value that cannot be computed on few samples becomes NaN; inputs the metric's update refuses (shapes
    that do not match) are the user's error, raised as in one process."""
    metric = torchmetrics.MeanSquaredError()
    share_computes(metric, holds_last=True, share=lambda value: value)
    run = StageRun(0, first_stage=True, incoming=None, exit_after=False, device=torch.device("cpu"))
    with running(run), pytest.raises(RuntimeError, match="same shape"):
        metric(torch.zeros(3), torch.zeros(4))


def test_a_metric_built_on_the_meta_device_is_refused_with_the_fix() -> None:
    module = nn.Module()
    module.layer = nn.Linear(2, 2)
    refuse_meta_states(module)  # (no metric: nothing to say)
    module.mse = torchmetrics.MeanSquaredError()
    refuse_meta_states(module)
    with torch.device("meta"):  # what configure_model builds under spot_pipeline
        module.mse = torchmetrics.MeanSquaredError()
    with pytest.raises(
        ModelContractError, match=r"`mse` \(MeanSquaredError\) was built in `configure_model`.*__init__"
    ):
        refuse_meta_states(module)
