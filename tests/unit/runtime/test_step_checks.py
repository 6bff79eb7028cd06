"""The last stage refuses a step whose result depends on what a module of an earlier stage computed (it only has a
stand-in for it there): a teacher run before the student, an embedding's output added around the whole sequence
(partition/step_checks.py). Before, such steps trained silently on constants."""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_spot import ModelContractError, discover, plan_stages
from lightning_spot.partition.placement import place_stages
from lightning_spot.partition.run_order import place_by_run
from lightning_spot.runtime.logging_bridge import LogCapture
from lightning_spot.runtime.step_runner import StepRunner
from tests.models import HIDDEN, IN, OUT, TinyPipelineModel, make_dataset


class _Distilled(TinyPipelineModel):
    """``uses``: "teacher-before" (a frozen teacher run before the model's forward, its output in the loss),
    "teacher-after" (the same teacher run after it), "skip" (the embedding's output added after the layers),
    "draws" (the teacher after, and noise from torch, Python and NumPy in the loss), "clock" (the teacher after, and
    a term that changes from run to run, as non-deterministic GPU kernels make results do)."""

    def __init__(self, uses: str) -> None:
        super().__init__()
        self.uses = uses
        self.teacher = nn.Linear(IN, OUT).requires_grad_(False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.uses == "skip":
            h = torch.relu(self.embed(x))
            return F.mse_loss(self.head(self.layers(h) + h), y)
        if self.uses == "teacher-before":
            target = self.teacher(x)
            out = self(x)
        else:
            out = self(x)
            target = self.teacher(x)
        loss = F.mse_loss(out, y) + F.mse_loss(out, target)
        if self.uses == "draws":
            loss = loss + torch.rand(()) * float(np.random.rand()) * random.random()
        elif self.uses == "clock":
            loss = loss + 1e-8 * (time.perf_counter_ns() % 1000)  # (up to 1e-5: a GPU's run-to-run noise)
        return loss


BATCH = make_dataset(8)[:]


def _last_stage_loss(module: nn.Module) -> torch.Tensor:
    split = place_by_run(module, discover(module), BATCH)
    place_stages(module, split, plan_stages(split.num_layers, 2), pp_rank=1, device=torch.device("cpu"))
    runner = StepRunner(module, num_stages=2, capture=LogCapture(), device=torch.device("cpu"))
    with runner.bind("training_step", "train", BATCH, (0,), {}):
        received = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(0)).requires_grad_()
        return runner.loss_fn((received, torch.arange(8)), torch.arange(8))


def test_a_value_used_around_the_layers_is_refused_by_name() -> None:
    """The embedding feeds the layers (first stage) and its output is added after them too: the last stage has
    only a stand-in for it."""
    with pytest.raises(ModelContractError) as err:
        _last_stage_loss(_Distilled("skip"))
    assert "uses, after the layer sequence, what `embed` computed on an earlier pipeline stage" in str(err.value)
    assert "carry it through the layers" in str(err.value)


def test_a_teacher_run_before_the_forward_goes_last_and_stands_in_on_the_first_stage() -> None:
    """Placement sees that the teacher's output does not reach the layers (only the loss uses it): it goes to the
    last stage, and the first stage's step runs it as a stand-in before its layers."""
    module = _Distilled("teacher-before")
    placed = place_by_run(module, discover(module), BATCH)
    assert "teacher" in placed.last_modules and placed.stand_in_before == ("teacher",)
    assert (
        "embed" in placed.first_modules
        and not place_by_run(_Distilled("skip"), discover(module), BATCH).stand_in_before
    )
    first = _Distilled("teacher-before")
    place_stages(first, placed, plan_stages(placed.num_layers, 2), pp_rank=0, device=torch.device("cpu"))
    runner = StepRunner(first, num_stages=2, capture=LogCapture(), device=torch.device("cpu"))
    with runner.bind("training_step", "train", BATCH, (0,), {}):
        (out,) = runner.stage_forward(0, (torch.arange(8),))
    assert out.shape == (8, HIDDEN)
    loss = _last_stage_loss(module)
    assert loss.requires_grad and type(module.teacher) is nn.Linear


@pytest.mark.parametrize("uses", ["teacher-after", "draws", "clock"])
def test_a_teacher_run_after_the_forward_goes_last_and_is_used_as_it_is(uses: str) -> None:
    """Not refused, also where the step draws at random after the layers or its result changes a little from run
    to run (the checking runs draw alike, and differ from each other by no more than two runs of the step do)."""
    module = _Distilled(uses)
    loss = _last_stage_loss(module)
    assert loss.requires_grad and torch.isfinite(loss)
    assert type(module.teacher) is nn.Linear, "the last stage holds the real teacher"


def test_checking_keeps_each_module_s_mode_and_the_random_state() -> None:
    module = _Distilled("teacher-after")
    module.teacher.eval()  # (the user keeps the frozen teacher in eval mode)
    state = torch.random.get_rng_state()
    _last_stage_loss(module)
    assert not module.teacher.training, "the teacher stays in eval mode"
    assert all(m.training for name, m in module.named_modules() if not name.startswith("teacher"))
    assert torch.equal(torch.random.get_rng_state(), state)


class _Codes(nn.Linear):
    """Returns token ids (a quantiser, say): an output that constants cannot stand in for so simply."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x).argmax(-1)


class _Quantized(TinyPipelineModel):
    def __init__(self) -> None:
        super().__init__()
        self.codes = _Codes(IN, 4)
        self.embed_codes = nn.Embedding(4, HIDDEN)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.embed_codes(self.codes(x)) + self.embed(x)
        return F.mse_loss(self.head(self.layers(h)), y)


def test_a_module_whose_ids_feed_the_layers_stays_first() -> None:
    """A module that returns ids feeds the layers through an embedding: it stays on the first stage (had it gone to
    the last, the first stage would have embedded a stand-in's zeros)."""
    module = _Quantized()
    placed = place_by_run(module, discover(module), BATCH)
    assert "codes" in placed.first_modules and not placed.stand_in_before
