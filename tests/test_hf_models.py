"""Hugging Face causal LMs (GPT-2, Llama, Qwen2) train pipelined, unchanged, like single-process Lightning.

The LightningModule (``tests.hf_models.CausalLM``) holds nothing pipeline-specific: it calls
``self.model(input_ids=ids, labels=ids).loss``. Stages after the first rebuild the masks, position ids and
rotary tables their first layer needs from shapes alone; that they equal the single-process values is
checked directly, and a value that depends on an earlier stage's numbers is refused by name.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from lightning_spot import ModelContractError, discover, plan_stages
from lightning_spot.partition.discovery import find_layer_sequence
from lightning_spot.partition.placement import place_stages
from lightning_spot.partition.stage_run import StageProbe, StageRun, running
from lightning_spot.runtime.logging_bridge import LogCapture
from lightning_spot.runtime.step_runner import StepRunner
from tests.hf_models import CausalLM, token_dataset
from tests.parity import assert_same_params, merged_state, reference_run, run_scenarios

LAYERS = {"gpt2": "model.transformer.h", "llama": "model.model.layers", "qwen2": "model.model.layers"}


def hf_scenario(family: str, layout: str, schedule: str, microbatches: int = 4, layers: str = "") -> dict[str, Any]:
    p = int(layout[1])
    return {
        "name": f"{family}-{layout}-{schedule}",
        "loader": {"batch_size": 8, "n": 32, "tokens": True},
        "trainer": {"max_steps": 4},
        "model": {"cls": "CausalLM", "family": family, "tied": False, "lr": 1e-3},
        "strategy": {
            "pipeline_stages": p,
            "microbatches": microbatches,
            "schedule": schedule,
            "layers": layers or LAYERS[family],
        },
    }


WORLD_2 = [  # the layer sequence found by layers="auto"
    hf_scenario("gpt2", "P2D1", "1F1B", layers="auto"),
    hf_scenario("llama", "P2D1", "ZBVZeroBubble", layers="auto"),
    hf_scenario("qwen2", "P2D1", "1F1B", layers="auto"),
]
WORLD_4 = [
    hf_scenario("gpt2", "P2D2", "1F1B"),
    hf_scenario("llama", "P4D1", "1F1B"),
    hf_scenario("qwen2", "P2D2", "Interleaved1F1B", microbatches=2),
]
ALL = {2: WORLD_2, 4: WORLD_4}


@pytest.fixture(scope="module")
def jobs() -> dict[int, dict[str, list[dict]]]:
    return {}


@pytest.mark.parametrize(
    ("world", "case"),
    [(w, c) for w, cases in ALL.items() for c in cases],
    ids=lambda v: v if isinstance(v, int) else v["name"],
)
def test_hf_causal_lm_matches_single_process_lightning(
    world: int, case: dict[str, Any], jobs: dict, tmp_path_factory: pytest.TempPathFactory
) -> None:
    if world not in jobs:
        jobs[world] = run_scenarios(world, ALL[world], tmp_path_factory.mktemp(f"hf-world{world}"), timeout=600)
    ranks = jobs[world][case["name"]]
    assert_same_params(merged_state(ranks), reference_run(case))
    assert all(len(r["state_dict"]) > 0 for r in ranks)


def _first_layer_arguments_single_process(family: str, layer: int, ids: torch.Tensor) -> dict[str, Any]:
    """What layer ``layer`` of the unsplit model receives besides the hidden state."""
    model = CausalLM(family).model
    seq = model.get_submodule(LAYERS[family].removeprefix("model."))
    seen: dict[str, Any] = {}

    def hook(mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        seen.update({f"positional argument {i + 2}": a for i, a in enumerate(args[1:])})
        seen.update({k: v for k, v in kwargs.items() if k != "hidden_states" or args})

    seq[layer].register_forward_pre_hook(hook, with_kwargs=True)
    with torch.no_grad():
        model(input_ids=ids, labels=ids)
    return seen


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_later_stage_rebuilds_its_first_layers_arguments_exactly(family: str) -> None:
    """Stage 1 of 2 holds layers 2-3: its layer 2 gets the masks, positions and rotary tables of a single run."""
    module = CausalLM(family)
    split = discover(module, LAYERS[family])
    place_stages(module, split, plan_stages(split.num_layers, 2), pp_rank=1, device=torch.device("cpu"))
    ids = token_dataset(4).tensors[0]
    run = StageRun(1, first_stage=False, incoming=None, exit_after=True, device=torch.device("cpu"), probe=True)
    with running(run), pytest.raises(StageProbe) as probe:
        module.training_step((ids,), 0)
    want = _first_layer_arguments_single_process(family, 2, ids)
    got = probe.value.arguments
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        if isinstance(value, torch.Tensor):
            assert not got[name].is_meta and torch.equal(got[name], value), name
        elif isinstance(value, tuple):  # rotary (cos, sin)
            assert all(torch.equal(a, b) for a, b in zip(got[name], value, strict=True)), name
        else:
            assert type(got[name]) is type(value), name


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
