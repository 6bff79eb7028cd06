"""Steps that run the layer sequence more than once (two views of a batch, chosen and rejected answers): every
stage sends all passes of a micro-batch at once (partition/stage_run.py, runtime/step_runner.py). The training math
is checked against one process in test_strategy_parity.py and test_hf_models.py; here, what is refused and what the
stages draw."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_spot import ModelContractError, discover, plan_stages
from lightning_spot.partition.placement import place_stages
from lightning_spot.partition.run_order import place_by_run
from lightning_spot.runtime.logging_bridge import LogCapture
from lightning_spot.runtime.step_runner import StepRunner
from tests.models import HIDDEN, IN, Block, TinyPipelineModel, make_dataset


class _Passes(TinyPipelineModel):
    """``kind``: "views" (two passes on inputs of their own), "r-drop" (the same input twice, the outputs compared),
    "again" (the layers applied to their own output), "alternating" (a second pass on odd batches only),
    "embed_after" (registers its embedding after the layers); ``dropout``: the layers drop activations (p=0.5)."""

    def __init__(self, kind: str = "views", dropout: bool = False) -> None:
        super().__init__()
        self.kind = kind
        if kind == "embed_after":  # registered after the layer sequence, run before each pass
            del self.embed
            self.embed = nn.Linear(IN, HIDDEN)
        if dropout:
            self.layers = nn.Sequential(*[nn.Sequential(Block(HIDDEN), nn.Dropout(0.5)) for _ in range(4)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.kind == "again":
            return F.mse_loss(self.head(self.layers(self.layers(torch.relu(self.embed(x))))), y)
        first = self(x)
        if self.kind == "alternating" and batch_idx % 2 == 0:
            return F.mse_loss(first, y)
        if self.kind == "r-drop":
            second = self(x)
            return F.mse_loss(first, y) + F.mse_loss(second, y) + F.mse_loss(first, second)
        return F.mse_loss(first, y) + F.mse_loss(self(x * 0.5), first.detach())


def _stage(module: nn.Module, stage: int, stages: int = 2) -> StepRunner:
    split = discover(module)
    place_stages(module, split, plan_stages(split.num_layers, stages), pp_rank=stage, device=torch.device("cpu"))
    return StepRunner(module, num_stages=stages, capture=LogCapture(), device=torch.device("cpu"))


BATCH = make_dataset(8)[:]


def test_the_first_stage_sends_both_passes_with_dropout_drawn_anew_for_the_second() -> None:
    """Each pass's output of the stage's last layer goes out in one tuple; the second pass's dropout masks are not
    the first's (R-Drop compares two draws on the same input), and both are the same at every replay of the
    micro-batch (the draws are seeded by step, micro-batch and replica)."""
    runner = _stage(_Passes("r-drop", dropout=True), 0)
    runner.draw_seed = 0
    with runner.bind("training_step", "train", BATCH, (0,), {}, microbatches=2):
        runner.chunk = 0
        out = runner.stage_forward(0, (torch.arange(4),))
        again = runner.stage_forward(0, (torch.arange(4),))
    assert len(out) == 2 and out[0].shape == out[1].shape == (4, HIDDEN)
    assert not torch.equal(out[0], out[1]), "the same input met the same dropout masks in both passes"
    assert all(torch.equal(a, b) for a, b in zip(out, again))


def test_a_pass_fed_by_an_earlier_pass_is_refused_by_name() -> None:
    """The layers applied again to their own output would need the last stage's output back on the first stage
    within one micro-batch's forward: refused on every stage, with what works instead."""
    for stage in (0, 1):
        runner = _stage(_Passes("again"), stage)
        with runner.bind("training_step", "train", BATCH, (0,), {}), pytest.raises(ModelContractError) as err:
            if stage == 0:
                runner.stage_forward(0, (torch.arange(8),))
            else:
                runner.loss_fn((torch.zeros(8, HIDDEN, requires_grad=True), torch.arange(8)), torch.arange(8))
        assert "Pass 2 of the step" in str(err.value) and "nn.Sequential(*layers, *layers)" in str(err.value)


def test_a_step_that_changes_its_number_of_passes_is_named() -> None:
    """The passes are counted at a step function's first step: a later step that runs the layers more or less often
    is refused on the stage that notices, naming the counts (not taken for a misplaced module alone)."""
    runner = _stage(_Passes("alternating"), 1)
    acts = (torch.zeros(8, HIDDEN, requires_grad=True), torch.arange(8))
    with runner.bind("training_step", "train", BATCH, (0,), {}):
        runner.loss_fn(acts, torch.arange(8))  # batch 0: one pass, counted
    with runner.bind("training_step", "train", BATCH, (1,), {}), pytest.raises(ModelContractError) as err:
        runner.loss_fn(acts, torch.arange(8))
    assert "as many times as its first step did (1, counted there)" in str(err.value)

    runner = _stage(_Passes("alternating"), 1)
    with runner.bind("training_step", "train", BATCH, (1,), {}):
        runner.loss_fn((*[torch.zeros(8, HIDDEN, requires_grad=True)] * 2, torch.arange(8)), torch.arange(8))
    with runner.bind("training_step", "train", BATCH, (0,), {}), pytest.raises(ModelContractError) as err:
        runner.loss_fn((*[torch.zeros(8, HIDDEN, requires_grad=True)] * 2, torch.arange(8)), torch.arange(8))
    assert "ran the layer sequence 1 time(s), and 2 times at its first step" in str(err.value)


def test_counting_the_passes_keeps_what_the_step_changes_after_its_forward() -> None:
    """The count runs the whole step once more on every stage: ``trainer.should_stop`` and the module's
    torchmetrics keep what they were."""
    import lightning as L
    import torchmetrics

    class Stopping(_Passes):
        def __init__(self) -> None:
            super().__init__()
            self.seen = torchmetrics.SumMetric()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            self.seen(torch.tensor(1.0))
            self.trainer.should_stop = True
            return loss

    module = Stopping()
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    module.trainer = trainer
    runner = _stage(module, 0)
    with runner.bind("training_step", "train", BATCH, (0,), {}):
        out = runner.stage_forward(0, (torch.arange(8),))
    assert len(out) == 2, "two passes counted"
    assert not trainer.should_stop, "only the last stage's step decides a stop"
    assert float(module.seen.compute()) == 0.0, "the first stage's runs do not count in the metric"


def test_a_module_registered_after_the_layers_and_run_before_each_pass_goes_first() -> None:
    """Placement by run order: what runs before the first pass is the first stage's, what runs after the last pass
    the last stage's; runs between passes decide nothing (before, the embedding's second run counted as after the
    layers, and the registration rule put it on the last stage)."""
    module = _Passes("embed_after")
    split = discover(module)
    assert "embed" in split.last_modules
    placed = place_by_run(module, split, make_dataset(4)[:2])
    assert placed.first_modules == ("embed",) and placed.last_modules == ("head",)
