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


def test_the_last_stage_recomputes_from_its_input_and_keeps_nothing_after() -> None:
    """The last stage's first block, checkpointed, is recomputed in the backward on the previous stage's output (the
    gradient reaching it equals that of a run without checkpointing); nothing of the step stays referenced."""
    import gc

    from lightning_spot.partition import stage_run

    grads = []
    for reentrant in (None, False):  # (None: no checkpoint, the reference)
        torch.manual_seed(0)
        module = CheckpointedModel(reentrant=bool(reentrant))
        if reentrant is None:
            module.train(False)  # (the model checkpoints only in training; the step's math is the same)
        split = discover(module)
        place_stages(module, split, plan_stages(split.num_layers, 2), pp_rank=1, device=torch.device("cpu"))
        runner = StepRunner(module, num_stages=2, capture=LogCapture(), device=torch.device("cpu"))
        x, y = make_dataset(4)[:]
        acts = torch.linspace(-1, 1, 4 * 16).view(4, 16).requires_grad_()
        with runner.bind("training_step", "train", (x, y), (0,), {}):
            loss = runner.loss_fn((acts, torch.arange(4)), torch.arange(4))
        loss.backward()
        grads.append(acts.grad)
        del loss, runner, module
        gc.collect()
        assert len(stage_run._FED_INSTEAD) == 0, "the step's tensors are not kept"
    torch.testing.assert_close(grads[1], grads[0])
