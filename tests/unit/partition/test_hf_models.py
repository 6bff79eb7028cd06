"""transformers models split into stages, in one process: the block sequence found, what a pipeline refuses by name."""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_spot import ModelContractError, discover, plan_stages
from lightning_spot.partition.discovery import find_layer_sequence
from lightning_spot.partition.placement import place_stages
from lightning_spot.runtime.logging_bridge import LogCapture
from lightning_spot.runtime.step_runner import StepRunner
from tests.hf_models import LAYERS, CausalLM


class KeepLayer(torch.nn.Linear):
    def forward(self, h: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(h) * keep


class ValueMaskModel(torch.nn.Module):
    """Its layers get a mask computed from the embedding's numbers: stage 1 cannot rebuild it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.layers = torch.nn.ModuleList(KeepLayer(8, 8) for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        keep = (h.sum(-1, keepdim=True) > 0).float()
        for layer in self.layers:
            h = layer(h, keep)
        return h

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch).sum()


def test_an_argument_computed_from_an_earlier_stages_values_is_refused_by_name() -> None:
    module = ValueMaskModel()
    split = discover(module)
    place_stages(module, split, plan_stages(2, 2), pp_rank=1, device=torch.device("cpu"))
    runner = StepRunner(module, num_stages=2, capture=LogCapture(), device=torch.device("cpu"))
    batch = torch.randint(0, 10, (4, 5))
    with runner.bind("training_step", "train", batch, (0,), {}), pytest.raises(ModelContractError) as err:
        runner._check_arguments(1, batch)
    assert "Layer `layers.1`" in str(err.value) and "receives `positional argument 2`" in str(err.value)


@pytest.mark.parametrize("family", ["falcon", "bloom"])
def test_blocks_that_return_tuples_pass_the_check_at_stage_boundaries(family: str) -> None:
    """Falcon's and Bloom's blocks return a tuple whose first element the loop takes (`outputs[0]`); passed through
    on a later stage, the block returns the hidden state itself and `[0]` takes its first row. The check that no
    code changes the hidden state at a stage boundary lets that through, at every cut of 4 blocks into 4 stages."""
    batch = torch.randint(0, 96, (4, 16))
    for rank in (1, 2, 3):
        module = CausalLM(family)
        split = discover(module)
        place_stages(module, split, plan_stages(4, 4), pp_rank=rank, device=torch.device("cpu"))
        runner = StepRunner(module, num_stages=4, capture=LogCapture(), device=torch.device("cpu"))
        with runner.bind("training_step", "train", (batch,), (0,), {}):
            runner._check_arguments(rank, (batch,))


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_auto_finds_the_block_sequence(family: str) -> None:
    module = CausalLM(family)
    assert find_layer_sequence(module) == LAYERS[family]
    assert discover(module).layers_path == LAYERS[family]


def test_auto_refuses_two_large_sequences_and_an_explicit_path_wins() -> None:
    import transformers

    config = transformers.T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=2, vocab_size=50)
    t5 = transformers.T5ForConditionalGeneration(config)
    with pytest.raises(ModelContractError, match=r"several large block sequences: 'decoder.block' .*'encoder.block'"):
        find_layer_sequence(t5)
    assert discover(t5, "decoder.block").layers_path == "decoder.block"


@pytest.mark.skipif(not find_spec("peft"), reason="peft is not installed")
@pytest.mark.parametrize("stages", [2, 1])
def test_save_pretrained_of_a_model_split_into_stages_is_refused(stages: int, tmp_path: Path) -> None:
    """On a rank holding part of the layers, peft's and transformers' ``save_pretrained`` would write that part
    (4 of 8 adapter tensors on P2's first stage) and loading it would fill the rest with fresh weights: refused by
    name, nothing written. With every stage on the rank (P1) they save as usual."""
    from tests.hf_models import LoRA

    module = LoRA("llama")
    split = discover(module, "model.base_model.model.model.layers")
    place_stages(module, split, plan_stages(4, stages), pp_rank=0, device=torch.device("cpu"))
    for model, flag in ((module.model, "--peft"), (module.model.get_base_model(), "--hf")):
        if stages == 1:
            model.save_pretrained(tmp_path / flag)
            assert (tmp_path / flag).is_dir()
            continue
        with pytest.raises(ModelContractError, match=rf"stage 0 \(layers 0-1\) of 2.*export PATH OUT {flag}"):
            model.save_pretrained(tmp_path / flag)
        assert not (tmp_path / flag).exists()


@pytest.mark.parametrize("router_logits", [True, False])
def test_a_mixture_of_experts_load_balancing_loss_is_refused_in_a_pipeline(router_logits: bool) -> None:
    """Mixtral with ``output_router_logits=True`` adds a load-balancing loss over the router logits of every layer;
    the last stage of a pipeline holds only its own layers' (a two-stage run trained other weights than one process:
    0.0075 apart after 4 steps, where training moved them by 0.004). The last stage refuses it by name; without the
    router logits the same model runs."""
    module = CausalLM("mixtral-router-logits" if router_logits else "mixtral")
    split = discover(module, "model.model.layers")
    place_stages(module, split, plan_stages(4, 2), pp_rank=1, device=torch.device("cpu"))
    runner = StepRunner(module, num_stages=2, capture=LogCapture(), device=torch.device("cpu"))
    batch = (torch.randint(0, 96, (4, 16)),)
    received = torch.randn(2, 16, 32, requires_grad=True)
    with runner.bind("training_step", "train", batch, (0,), {}, microbatches=2):
        if router_logits:
            with pytest.raises(ModelContractError, match="output_router_logits=False"):
                runner.loss_fn(runner.stage_forward(1, (received,)), torch.arange(2))
        else:
            loss = runner.loss_fn(runner.stage_forward(1, (received,)), torch.arange(2))
            loss.backward()
            assert received.grad is not None
