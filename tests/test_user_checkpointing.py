"""The user's own ``torch.utils.checkpoint`` around the blocks (parity: P2D1-user-checkpoint-per-block). Its reentrant
variant connects gradients to the checkpoint's own arguments and outputs only: at a stage's boundary that would cut
the pipeline's gradient silently (the stages before kept their initial weights), so it is refused by name."""

from __future__ import annotations

import pytest
import torch

from lightning_spot import ModelContractError, discover, plan_stages
from lightning_spot.partition.placement import place_stages
from lightning_spot.runtime.logging_bridge import LogCapture
from lightning_spot.runtime.step_runner import StepRunner
from tests.models import CheckpointedModel, make_dataset


def _first_stage(reentrant: bool) -> tuple[StepRunner, tuple]:
    module = CheckpointedModel(reentrant=reentrant)
    split = discover(module)
    place_stages(module, split, plan_stages(split.num_layers, 2), pp_rank=0, device=torch.device("cpu"))
    return StepRunner(module, num_stages=2, capture=LogCapture(), device=torch.device("cpu")), make_dataset(4)[:]


def test_a_reentrant_checkpoint_at_a_stage_boundary_is_refused_by_name() -> None:
    runner, batch = _first_stage(reentrant=True)
    with runner.bind("training_step", "train", batch, (0,), {}), pytest.raises(ModelContractError) as err:
        runner.stage_forward(0, (torch.arange(4),))
    assert "Layer `layers.1` runs inside `torch.utils.checkpoint.checkpoint(..., use_reentrant=True)`" in str(err.value)
    assert "use_reentrant=False" in str(err.value)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
def test_the_non_reentrant_checkpoint_and_evaluation_run() -> None:
    runner, batch = _first_stage(reentrant=False)
    with runner.bind("training_step", "train", batch, (0,), {}):
        (out,) = runner.stage_forward(0, (torch.arange(4),))
    assert out.requires_grad, "the stage's output carries the gradient back to its layers"
    runner, batch = _first_stage(reentrant=True)
    with runner.bind("validation_step", "eval", batch, (0,), {}), torch.no_grad():
        runner.stage_forward(0, (torch.arange(4),))  # (a reentrant checkpoint outside training: not refused)
