"""The planner's choices change sensibly with world size, memory and model, and its models are consistent."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any

import pytest

from lightning_spot import LayoutError
from lightning_spot.planning.cost_model import evaluate, in_flight, plan_layouts, predict_step_seconds
from lightning_spot.planning.hardware import Hardware
from lightning_spot.planning.profile import LayerProfile, ModelProfile

MB = 2**20


def transformer(layers: int = 8, *, layer_s: float = 0.01, param_mb: float = 100, saved_mb: float = 50) -> ModelProfile:
    """A synthetic profile (at 8 samples per micro-batch) of a uniform transformer."""
    block = LayerProfile(layer_s, 2 * layer_s, int(param_mb * MB), int(saved_mb * MB), int(4 * MB))
    head = LayerProfile(layer_s, 2 * layer_s, int(param_mb * MB), int(saved_mb * MB), 4)
    embed = LayerProfile(layer_s / 10, layer_s / 10, int(param_mb * MB), int(4 * MB), int(4 * MB))
    return ModelProfile(8, "cuda", [block] * layers, embed, head)


FAST_NET = Hardware(memory_bytes=80 * 2**30, p2p_bytes_per_s=50e9, allreduce_bytes_per_s=50e9)


def test_plenty_of_memory_prefers_data_parallelism() -> None:
    best = plan_layouts(transformer(), world_size=8, global_batch=64, hardware=FAST_NET)[0]
    assert best.pipeline_stages == 1 and best.data_parallel == 8  # no bubble when everything fits everywhere


def test_tight_memory_forces_a_deeper_pipeline_or_recomputation() -> None:
    roomy = plan_layouts(transformer(), world_size=8, global_batch=64, hardware=FAST_NET)[0]
    tight = plan_layouts(transformer(), world_size=8, global_batch=64, hardware=Hardware(memory_bytes=2.5 * 2**30))[0]
    assert tight.pipeline_stages > roomy.pipeline_stages or tight.activation_checkpointing
    assert max(tight.stage_bytes) <= 2.5 * 2**30


def test_more_devices_give_more_throughput() -> None:
    small = plan_layouts(transformer(), world_size=2, global_batch=64, hardware=FAST_NET)[0]
    large = plan_layouts(transformer(), world_size=8, global_batch=64, hardware=FAST_NET)[0]
    assert large.samples_per_second > small.samples_per_second


def test_slow_network_avoids_data_parallel_allreduce() -> None:
    slow = Hardware(memory_bytes=80 * 2**30, allreduce_bytes_per_s=0.2e9, p2p_bytes_per_s=50e9)
    best = plan_layouts(transformer(), world_size=8, global_batch=64, hardware=slow)[0]
    assert best.data_parallel < 8  # all-reducing 4.5 GB of gradients over a slow link costs more than a bubble


def test_uneven_layers_get_balanced_cuts() -> None:
    profile = transformer(6)
    heavy = LayerProfile(
        0.06, 0.12, profile.layers[0].param_bytes, profile.layers[0].saved_bytes, profile.layers[0].output_bytes
    )
    profile.layers = [heavy, *profile.layers[1:]]
    candidate = evaluate(
        profile, pipeline_stages=2, data_parallel=1, microbatches=8, global_batch=64, hardware=FAST_NET
    )
    assert candidate.cuts == [1], "the heavy first layer gets a stage of its own"
    uniform = evaluate(
        profile, pipeline_stages=2, data_parallel=1, microbatches=8, global_batch=64, hardware=FAST_NET, cuts=[3]
    )
    assert candidate.predicted_step_seconds < uniform.predicted_step_seconds


def test_1f1b_holds_fewer_microbatches_than_gpipe() -> None:
    assert [in_flight("1F1B", s, 4, 16) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight("GPipe", s, 4, 16) for s in range(4)] == [16] * 4
    gpipe = evaluate(
        transformer(), pipeline_stages=4, data_parallel=1, microbatches=16, global_batch=128, schedule="GPipe"
    )
    one_f = evaluate(
        transformer(), pipeline_stages=4, data_parallel=1, microbatches=16, global_batch=128, schedule="1F1B"
    )
    assert max(one_f.stage_bytes) < max(gpipe.stage_bytes)


def test_bubble_shrinks_with_more_microbatches() -> None:
    profile = transformer()
    few = predict_step_seconds(
        profile.scaled(16), [2, 4, 6], data_parallel=1, microbatches=4, checkpointing=False, hardware=FAST_NET
    )[0]
    many = predict_step_seconds(
        profile.scaled(4), [2, 4, 6], data_parallel=1, microbatches=16, checkpointing=False, hardware=FAST_NET
    )[0]
    assert many < few  # same global batch, smaller bubble


def test_nothing_fits_is_a_clear_error() -> None:
    with pytest.raises(
        LayoutError,
        match=r"No layout of 2 devices fits a global batch of 64 samples in 1\.0 GiB per device\. The least memory any layout needs is",
    ):
        plan_layouts(transformer(), world_size=2, global_batch=64, hardware=Hardware(memory_bytes=2**30))


def test_plan_command_json(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from lightning_spot.cli import main

    argv = [
        "plan",
        "--model",
        "examples.gpt.model:TinyGPT",
        "--init-args",
        '{"n_layer": 4, "d_model": 64}',
        "--world-size",
        "4",
        "--device-memory",
        "3MB",
        "--global-batch",
        "32",
        "--input-shape",
        "4x64",
        "--input-dtype",
        "int64",
        "--input-high",
        "256",
        "--device",
        "cpu",
    ]
    assert main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    for key in (
        "pipeline_stages",
        "data_parallel",
        "microbatches",
        "schedule",
        "cuts",
        "stage_seconds",
        "stage_bytes",
        "predicted_step_seconds",
    ):
        assert key in plan
    assert plan["pipeline_stages"] * plan["data_parallel"] == 4
    # 3 MB cannot hold the whole model's training state: several stages, or one with some of it in host memory
    # (which the planner may prefer when the profile is timed on a busy machine)
    assert plan["pipeline_stages"] > 1 or set(plan["offload"]) & {"optimizer", "parameters"}, plan
    assert max(plan["stage_bytes"]) <= 3e6 and len(plan["cuts"]) == plan["pipeline_stages"] - 1
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "best layout for 4 devices" in text and "stage 0: layers 0-" in text and "predicted step" in text
    assert "  without offload: " in text and "  with offload: " in text  # predicted step time either way


def test_plan_command_explains_missing_inputs(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_spot.cli import main

    with pytest.raises(SystemExit, match="needs forward inputs: define `example_input_array`"):
        main(
            [
                "plan",
                "--model",
                "examples.gpt.model:TinyGPT",
                "--world-size",
                "2",
                "--device-memory",
                "1GB",
                "--global-batch",
                "8",
                "--device",
                "cpu",
            ]
        )


def test_offload_is_chosen_only_when_nothing_else_fits() -> None:
    """offload="auto": with room, the state stays on the device (copies cost time); when weights, gradients and
    Adam state do not fit, the optimizer goes to host memory; without enough host memory, the error says so."""
    from lightning_spot.planning.cost_model import OFFLOAD_CHOICES

    model = transformer(4, param_mb=256, saved_mb=8)  # 1 GB of weights + 4 GB of training state per layer pair
    roomy = Hardware(memory_bytes=80 * 2**30, host_memory_bytes=200 * 2**30)
    best = plan_layouts(model, world_size=1, global_batch=8, hardware=roomy, offloads=OFFLOAD_CHOICES)[0]
    assert best.offload == []
    tight = Hardware(memory_bytes=3.5 * 2**30, host_memory_bytes=200 * 2**30)
    with pytest.raises(LayoutError):
        plan_layouts(model, world_size=1, global_batch=8, hardware=tight)
    offloaded = plan_layouts(model, world_size=1, global_batch=8, hardware=tight, offloads=OFFLOAD_CHOICES)[0]
    assert "optimizer" in offloaded.offload and max(offloaded.stage_bytes) <= 3.5 * 2**30
    assert offloaded.predicted_step_seconds > best.predicted_step_seconds  # the copies and the host update cost
    assert "offload optimizer" in offloaded.describe()
    no_host = Hardware(memory_bytes=3.5 * 2**30, host_memory_bytes=1 * 2**30)
    with pytest.raises(LayoutError, match="host memory was considered"):
        plan_layouts(model, world_size=1, global_batch=8, hardware=no_host, offloads=OFFLOAD_CHOICES)


def test_weights_are_streamed_only_when_nothing_else_fits() -> None:
    """offload="auto": streaming the weights (LoopedBFS, one layer per stage, two layers' weights on the device)
    is the last resort; it fits where even the optimizer and activations in host memory do not."""
    from lightning_spot.planning.cost_model import OFFLOAD_CHOICES

    model = transformer(8, param_mb=256, saved_mb=8)
    host = 200 * 2**30
    roomier = plan_layouts(
        model,
        world_size=2,
        global_batch=8,
        hardware=Hardware(3 * 2**30, host_memory_bytes=host),
        offloads=OFFLOAD_CHOICES,
    )
    assert all("parameters" not in c.offload for c in roomier) and "optimizer" in roomier[0].offload
    tight = Hardware(memory_bytes=2 * 2**30, host_memory_bytes=host)
    best = plan_layouts(model, world_size=2, global_batch=8, hardware=tight, offloads=OFFLOAD_CHOICES)[0]
    assert "parameters" in best.offload and best.schedule == "LoopedBFS"
    assert best.layout.stages == 8 and best.layout.pipeline_stages == 2  # one layer per stage, 4 per rank
    # each rank: two layers' weights and gradients (2 x 2 x 256 MB) and the embedding or head's (2 x 256 MB)
    assert 1.5 * 2**30 <= max(best.stage_bytes) <= 2 * 2**30
    assert "offload optimizer+parameters" in best.describe()
    with pytest.raises(LayoutError, match=r"needs is 1\.5 GiB .*LoopedBFS.*offload optimizer\+parameters"):
        plan_layouts(
            model, world_size=2, global_batch=8, hardware=replace(tight, memory_bytes=2**30), offloads=OFFLOAD_CHOICES
        )


def test_a_model_held_by_the_lightning_module_is_profiled_through_the_call_its_step_makes() -> None:
    """``training_step`` calls ``self.net(x)`` (no ``self(...)``): the planner profiles ``net`` with the inputs the
    step gives it; a layer 128x as wide is measured more than twice as slow as the others. A step that calls
    neither is refused with the sequence named."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch import nn

    from lightning_spot.partition.discovery import ModelContractError, discover
    from lightning_spot.planning.profile import forward_call, profile_model, rooted

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(16, 32)
            wide = nn.Sequential(nn.Linear(32, 4096), nn.GELU(), nn.Linear(4096, 32))
            self.blocks = nn.Sequential(wide, *(nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(3)))
            self.head = nn.Linear(32, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.blocks(self.embed(x)))

    class Holder(L.LightningModule):
        def __init__(self, call: bool = True) -> None:
            super().__init__()
            self.net, self.call = Net(), call

        def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
            x, y = batch
            out = self.net(x) if self.call else self.net.head(self.net.embed(x))
            return F.cross_entropy(out.flatten(0, 1), y.flatten())

    module = Holder()
    split = discover(module)
    assert split.layers_path == "net.blocks"
    batch = (torch.randint(0, 16, (64, 32)), torch.randint(0, 16, (64, 32)))
    root, args, kwargs = forward_call(module, split, batch)
    assert root == "net" and args[0].shape == (64, 32) and not kwargs
    net, inner = rooted(module, split, root)
    assert net is module.net and inner.layers_path == "blocks" and inner.first_modules == ("embed",)
    profile = profile_model(net, inner, args, kwargs, device=torch.device("cpu"), samples=64, repeats=3)
    wide, *narrow = (layer.forward_s + layer.backward_s for layer in profile.layers)
    assert wide > 2 * max(narrow), [round(t * 1e3, 3) for t in (wide, *narrow)]
    with pytest.raises(ModelContractError, match="net.blocks"):
        forward_call(Holder(call=False), split, batch)


def test_transformers_models_are_profiled_through_a_real_forward() -> None:
    """``self.model(**batch).loss`` on padded batches (a Llama) and ``self.model(input_ids=..., labels=...)`` (a
    GPT-2 with tied weights): their forwards cannot run on the meta device (masks call ``.item()``), so the profile
    runs the model for real with its layers passing their input through, then times each layer alone (its KV
    cache fresh for every run). Every layer and both ends get a time; the embeddings and the head are found."""
    pytest.importorskip("transformers")
    import torch

    from lightning_spot.partition.discovery import discover
    from lightning_spot.planning.profile import forward_call, profile_model, rooted
    from tests.hf_models import CausalLM, FineTune, padded_loader, token_loader

    for module, batch, ends in (
        (FineTune("llama"), next(iter(padded_loader("sft", 4))), ("model.embed_tokens", "lm_head")),
        (CausalLM("gpt2", tied=True), next(iter(token_loader(4))), ("transformer.wte", "lm_head")),
    ):
        split = discover(module)
        root, args, kwargs = forward_call(module, split, batch)
        model, inner = rooted(module, split, root)
        assert root == "model" and ends[0] in inner.first_modules and ends[1] in inner.last_modules, inner
        profile = profile_model(model, inner, args, kwargs, device=torch.device("cpu"), samples=4, repeats=2)
        assert len(profile.layers) == 4 and all(
            layer.forward_s > 0 and layer.backward_s > 0 for layer in profile.layers
        )
        assert profile.first.forward_s > 0 and profile.last.forward_s > 0 and profile.last.backward_s > 0
        assert all(layer.saved_bytes > 0 for layer in profile.layers)


def test_pipelines_that_decide_alone_take_the_simple_rules_not_measurements(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The pipelines of a torchft job choose their layouts without talking to each other and must cut the model
    alike: with ``measured=False`` nothing is profiled (the profile cache stays empty) and the cuts are even even
    where one layer is 16x as wide; ``partition='balanced'`` says why it is not used."""
    import torch
    from torch import nn

    from lightning_spot.partition.discovery import discover
    from lightning_spot.planning.choose import Requested, choose_layout

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            wide = nn.Sequential(nn.Linear(32, 512), nn.GELU(), nn.Linear(512, 32))
            self.layers = nn.Sequential(wide, *(nn.Linear(32, 32) for _ in range(3)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers(x)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self(batch).square().mean()

    module = Model()
    split = discover(module)
    for partition in ("auto", "balanced"):
        requested = Requested(2, "auto", "auto", partition, None, None, None)
        choice = choose_layout(
            module,
            split,
            requested,
            (16, torch.randn(16, 32)),
            world_size=2,
            device=torch.device("cpu"),
            autocast=contextlib.nullcontext,
            cache_dir=tmp_path,
            measured=False,
        )
        assert choice.layout.cuts == (2,) and choice.layout.microbatches == 4 and not choice.activation_checkpointing
    assert not any(tmp_path.iterdir()), "nothing was profiled or measured"
    assert "partition='balanced' is not used" in caplog.text
