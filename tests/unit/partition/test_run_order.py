"""Modules beside the layer sequence go to the stage where the step runs them, whatever order ``__init__``
registered them in (OPT registers its decoder's ``final_layer_norm`` before ``layers``)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import default_collate

from lightning_spot import ModelContractError, discover, plan_stages
from lightning_spot.partition.placement import place_stages
from lightning_spot.partition.run_order import place_by_run
from lightning_spot.partition.stage_run import SkippedLayer
from lightning_spot.runtime.logging_bridge import LogCapture
from lightning_spot.runtime.step_runner import StepRunner
from tests.models import HeadBeforeLayersModel, make_dataset

OPT_NORM = "model.model.decoder.final_layer_norm"


def _opt() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    pytest.importorskip("transformers")
    from tests.hf_models import FineTune, padded_dataset

    return FineTune("opt", "causal", tied=True), default_collate(padded_dataset("sft", 2))


def test_opts_final_norm_goes_to_the_last_stage() -> None:
    module, batch = _opt()
    split = discover(module)
    assert OPT_NORM in split.first_modules, "registered before `layers`: the registration rule gets it wrong"
    placed = place_by_run(module, split, batch)
    assert OPT_NORM in placed.last_modules and OPT_NORM not in placed.first_modules
    assert "model.model.decoder.embed_tokens" in placed.first_modules  # (and the tied head still runs last)
    assert "model.lm_head" in placed.last_modules
    assert placed.layer_names == split.layer_names and placed.layers_path == split.layers_path
    assert not any(isinstance(m, SkippedLayer) for m in module.modules()), "the layers are back"


def test_a_head_registered_first_goes_last_and_overrides_stay() -> None:
    module = HeadBeforeLayersModel()
    batch = make_dataset(4)[:2]
    split = discover(module)
    assert split.first_modules == ("head", "embed")
    placed = place_by_run(module, split, batch)
    assert placed.first_modules == ("embed",) and placed.last_modules == ("head",)
    pinned = discover(module, first_stage_modules=["head"])
    assert place_by_run(module, pinned, batch, fixed=("head",)) == pinned, "first_stage_modules wins"
    before = {k: v.clone() for k, v in module.state_dict().items()}
    place_by_run(module, split, batch)
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items()), "the run changes nothing"


def test_without_a_run_the_registration_rule_applies_and_a_misplaced_module_is_named() -> None:
    """Modules on the meta device (built in configure_model) cannot run: registration order, and stage 1 names
    the module that ran on its side of the sequence and the override that fixes it."""
    with torch.device("meta"):
        meta = HeadBeforeLayersModel()
    split = discover(meta)
    assert place_by_run(meta, split, make_dataset(2)[:2]) == split

    module = HeadBeforeLayersModel()
    split = discover(module)
    place_stages(module, split, plan_stages(split.num_layers, 2), pp_rank=1, device=torch.device("cpu"))
    runner = StepRunner(module, num_stages=2, capture=LogCapture(), device=torch.device("cpu"))
    x, y = make_dataset(4)[:]
    acts = torch.zeros(4, 16, requires_grad=True)
    with runner.bind("training_step", "train", (x, y), (0,), {}), pytest.raises(ModelContractError) as err:
        runner.loss_fn((acts, torch.arange(4)), torch.arange(4))
    assert "Module `head` was placed on the first stage but runs on stage 1" in str(err.value)
    assert "last_stage_modules" in str(err.value)


def test_a_step_run_to_find_where_modules_go_leaves_the_metrics_as_they_were() -> None:
    """Placement and profiling run the user's training step outside training: the torchmetrics it updates keep
    their states (an epoch's value counted the placement run's batch on the rank that ran it)."""
    import lightning as L
    import torchmetrics

    from lightning_spot.partition.run_order import run_step_quietly

    class Counting(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.Sequential(torch.nn.Linear(2, 2))
            self.seen = torchmetrics.SumMetric()

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            self.seen(torch.tensor(float(len(batch))))
            self.log("seen", self.seen)
            return self.layers(batch).sum()

    module = Counting()
    module.seen(torch.tensor(5.0))
    run_step_quietly(module, torch.ones(3, 2))
    assert float(module.seen.compute()) == 5.0 and module.seen._update_count == 1


def test_loose_parameters_go_where_the_step_uses_them_and_a_misplaced_one_is_named() -> None:
    """Parameters set directly on the module are read as tensors, not called: the position table feeds the layers
    (first stage), the temperature only scales what they return (last stage, though registered first). Pinned to
    the first stage by the user, the temperature is named at the last stage's first step."""
    from lightning_spot.partition.loose_params import MisplacedParameterError
    from tests.models import EncoderModel

    module = EncoderModel()
    batch = make_dataset(4)[:2]
    split = discover(module)
    assert split.first_direct_params == ("temperature", "pos") and not split.last_direct_params
    placed = place_by_run(module, split, batch)
    assert placed.first_direct_params == ("pos",) and placed.last_direct_params == ("temperature",)
    assert place_by_run(module, split, batch) == placed, "the runs left the parameters as they were"

    pinned = discover(module, first_stage_modules=["temperature"])
    assert place_by_run(module, pinned, batch, fixed=("temperature",)).first_direct_params == ("temperature", "pos")
    place_stages(module, pinned, plan_stages(pinned.num_layers, 2), pp_rank=1, device=torch.device("cpu"))
    assert {n for n, _ in module.named_parameters()} >= {"head.weight"} and "pos" not in dict(module.named_parameters())
    runner = StepRunner(module, num_stages=2, capture=LogCapture(), device=torch.device("cpu"))
    x, y = make_dataset(4)[:]
    acts = torch.zeros(4, 3, 16, requires_grad=True)
    with runner.bind("training_step", "train", (x, y), (0,), {}), pytest.raises(MisplacedParameterError) as err:
        runner.loss_fn((acts, torch.arange(4)), torch.arange(4))
    assert "Parameter `temperature` was placed on the first stage but is used on stage 1" in str(err.value)
