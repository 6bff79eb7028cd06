"""Hugging Face causal LMs (GPT-2, Llama, Qwen2) train pipelined, unchanged, like single-process Lightning.

The LightningModule (``tests.hf_models.CausalLM``) holds nothing pipeline-specific: it calls
``self.model(input_ids=ids, labels=ids).loss``. Stages after the first rebuild the masks, position ids and
rotary tables their first layer needs from shapes alone; that they equal the single-process values is
checked directly, and a value that depends on an earlier stage's numbers is refused by name.
"""

from __future__ import annotations

import json
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_spot import discover, plan_stages
from lightning_spot.checkpoint.tools.export_peft import export_peft
from lightning_spot.partition.placement import place_stages
from lightning_spot.partition.stage_run import StageProbe, StageRun, running
from tests.hf_models import LAYERS, CausalLM, FineTune, token_dataset
from tests.parity import assert_same_params, merged_state, reference_run, run_scenarios, shared_job

pytest.importorskip("transformers")


def hf_scenario(
    family: str,
    layout: str,
    schedule: str,
    microbatches: int = 4,
    layers: str = "",
    tied: bool = False,
    trainer: dict[str, Any] | None = None,
    offload: list[str] | None = None,
) -> dict[str, Any]:
    p = int(layout[1])
    return {
        "name": f"{family}{'-tied' if tied else ''}-{layout}-{schedule}{'-offload-' + '+'.join(offload) if offload else ''}",
        "loader": {"batch_size": 8, "n": 32, "tokens": True},
        "trainer": {"max_steps": 4, **(trainer or {})},
        "model": {"cls": "CausalLM", "family": family, "tied": tied, "lr": 1e-3},
        "strategy": {
            "pipeline_stages": p,
            "microbatches": microbatches,
            "schedule": schedule,
            "layers": layers or LAYERS[family],
            **({"offload": offload} if offload else {}),
        },
    }


def fine_tune_scenario(
    family: str,
    kind: str,
    task: str,
    stages: int | list[int],
    *,
    microbatches: int = 4,
    tied: bool = False,
    loss: str = "model",
    schedule: str = "1F1B",
) -> dict[str, Any]:
    """Fine-tuning on padded batches whose micro-batches hold different numbers of real (not -100) labels."""
    layout = "+".join(map(str, stages)) if isinstance(stages, list) else f"P{stages}"
    return {
        "name": f"finetune-{family}-{kind}-{layout}-{loss}",
        "loader": {"batch_size": 8, "n": 32, "padded": task},
        "trainer": {"max_steps": 4},
        "model": {"cls": "FineTune", "family": family, "kind": kind, "tied": tied, "lr": 1e-3, "loss": loss},
        "strategy": {"pipeline_stages": stages, "microbatches": microbatches, "schedule": schedule},
    }


#: (micro-batches of one or two samples): BERT masked LM, causal-LM fine-tuning with prompt and padding masked
#: (Llama, OPT, whose decoder registers its final norm before its layers, GPT-2, whose loss type is None, Qwen2), a
#: classification head, mixed depths
FINE_TUNE_4 = [
    fine_tune_scenario("bert", "masked", "mlm", 2, tied=True),
    fine_tune_scenario("llama", "causal", "sft", 2),
    fine_tune_scenario("gpt2", "causal", "sft", 2, tied=True),
    fine_tune_scenario("qwen2", "causal", "sft", 2, tied=True),
    fine_tune_scenario("bert", "classify", "classify", 2, microbatches=2, tied=True),
    fine_tune_scenario("opt", "causal", "sft", 2, tied=True),
    fine_tune_scenario("llama", "causal", "sft", [1, 3]),
]


#: a hand-written mean over the labels that are not -100: undeclared (warned about) and declared
FINE_TUNE_2 = [
    fine_tune_scenario("llama", "causal", "sft", 2, loss="mean"),
    fine_tune_scenario("llama", "causal", "sft", 2, loss="counted"),
]


WORLD_2 = [  # the layer sequence found by layers="auto"
    hf_scenario("gpt2", "P2D1", "1F1B", layers="auto"),
    hf_scenario("llama", "P2D1", "ZBVZeroBubble", layers="auto"),
    hf_scenario("qwen2", "P2D1", "1F1B", layers="auto"),
    hf_scenario("gpt2", "P2D1", "1F1B", tied=True),
    # V-shaped: the first and the last stage (embedding and head) on one rank, a copy each
    hf_scenario("qwen2", "P2D1", "ZBVZeroBubble", tied=True),
]


#: where the jobs' scenarios keep their checkpoints (replaced by a folder of the job's)
RUNS = "{runs}"


LLAMA_P4 = hf_scenario("llama", "P4D1", "1F1B")


LLAMA_P4["spot_checkpoint"] = {"dirpath": f"{RUNS}/llama", "every_n_train_steps": 2, "snapshots": False}  # DCP shards


#: a model of the contract whose last checkpoint is made of snapshot files (kind "shares"), exported below
TINY_SHARES = {
    "name": "tiny-P2D2-snapshot-shares",
    "loader": {"batch_size": 16, "n": 64},
    "trainer": {"max_steps": 4},
    "strategy": {"pipeline_stages": 2, "microbatches": 2},
    "spot_checkpoint": {
        "dirpath": f"{RUNS}/tiny",
        "every_n_train_steps": 2,
        "snapshot_every_n_train_steps": 1,
        "snapshot_dir": f"{RUNS}/shm",
    },
}


WORLD_4 = [
    hf_scenario("gpt2", "P2D2", "1F1B"),
    LLAMA_P4,
    hf_scenario("qwen2", "P2D2", "Interleaved1F1B", microbatches=2),
    hf_scenario("llama", "P2D2", "1F1B", tied=True),
    hf_scenario("gpt2", "P4D1", "1F1B", tied=True, trainer={"gradient_clip_val": 0.5}),  # norms count a tie once
    # every offload level on a model we did not write: Llama's decoder layers streamed one per stage
    hf_scenario("llama", "P2D2", "LoopedBFS", tied=True, offload=["parameters", "activations"]),
    # preference tuning: two passes per step (chosen and rejected answers) through GPT-2 whose embedding and head
    # (tied) sit on different stages, on padded batches
    {
        **hf_scenario("gpt2", "P2D2", "1F1B", microbatches=2, tied=True),
        "name": "preference-gpt2-tied-P2D2",
        "loader": {"batch_size": 8, "n": 32, "padded": "sft"},
        "model": {"cls": "Preference", "family": "gpt2", "tied": True, "lr": 1e-3},
    },
]


#: LoRA adapters (peft) on a Llama whose layers are split in two, replicated twice, fine-tuned on padded batches with
#: masked labels, checkpointed and exported
LORA = {
    **hf_scenario("llama", "P2D2", "1F1B", microbatches=2, layers="auto"),  # model.base_model.model.model.layers
    "name": "lora-llama-P2D2",
    "loader": {"batch_size": 8, "n": 32, "padded": "sft"},
    "model": {"cls": "LoRA", "family": "llama"},
    "spot_checkpoint": {"dirpath": f"{RUNS}/lora", "every_n_train_steps": 2, "snapshots": False},
}


#: text generated by the model outside steps: at each validation's end (greedy) and after fit (sampled), on a
#: Llama split in two and replicated twice, and on a V-shaped pipeline (stages 0 and 3 on one rank)
SAMPLING = {
    world: {
        **hf_scenario(family, layout, schedule, trainer={"val_check_interval": 2, "limit_val_batches": 1}),
        "name": f"sampling-{family}-{layout}-{schedule}",
        "model": {"cls": "Sampling", "family": family, "lr": 1e-3},
        "val_loader": {"batch_size": 8, "n": 8, "tokens": True},
        "after": ["generate"],
    }
    for world, family, layout, schedule in ((4, "llama", "P2D2", "1F1B"), (2, "qwen2", "P2D1", "ZBVZeroBubble"))
}


TIED_NAMES = {"gpt2": ("model.transformer.wte.weight", "model.lm_head.weight")}


TIED_NAMES["llama"] = TIED_NAMES["qwen2"] = ("model.model.embed_tokens.weight", "model.lm_head.weight")


ALL = {
    2: [*WORLD_2, *FINE_TUNE_2, SAMPLING[2]],
    4: [*WORLD_4, *FINE_TUNE_4, TINY_SHARES, SAMPLING[4], *([LORA] if find_spec("peft") else [])],
}


@pytest.fixture(scope="module")
def jobs() -> dict[int, dict[str, list[dict]]]:
    return {}


def _job(world: int, jobs: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    def run() -> dict[str, list[dict]]:
        tmp = tmp_path_factory.mktemp(f"hf-world{world}")
        scenarios = json.loads(json.dumps(ALL[world]).replace(RUNS, str(tmp / "runs")))
        jobs[f"runs{world}"] = tmp / "runs"
        return run_scenarios(world, scenarios, tmp, timeout=600)

    return shared_job(jobs, world, run)  # type: ignore[no-any-return]


@pytest.mark.parametrize("case", FINE_TUNE_4, ids=lambda c: c["name"])
def test_padded_fine_tuning_matches_single_process_lightning(
    case: dict[str, Any], jobs: dict, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Losses that transformers averages over the labels that are not -100 count by those labels: the same
    parameters and the same logged loss as one process training on the whole global batch."""
    ranks = _job(4, jobs, tmp_path_factory)[case["name"]]
    reference = reference_run(case)
    assert_same_params(merged_state(ranks), reference)
    for rank in ranks:
        assert rank["metrics"]["train_loss"] == pytest.approx(reference["metrics"]["train_loss"], rel=1e-5)
        assert not [w for w in rank["warnings"] if "num_items" in w]
    if isinstance(case["strategy"]["pipeline_stages"], list):
        assert {r["layout"] for r in ranks} == {"P1+P3"}


def test_a_hand_written_mean_over_a_varying_count_is_warned_about_until_it_is_weighted(
    jobs: dict, tmp_path_factory: pytest.TempPathFactory
) -> None:
    mean, counted = (_job(2, jobs, tmp_path_factory)[c["name"]] for c in FINE_TUNE_2)
    reference = reference_run(FINE_TUNE_2[0])  # the same loss either way in one process
    warned = [w for rank in mean for w in rank["warnings"] if "'num_items'" in w]
    assert len(warned) == 1 and "ignore_index" in warned[0], [r["warnings"] for r in mean]
    with pytest.raises(AssertionError, match="differ from the single-process run"):
        assert_same_params(merged_state(mean), reference)  # each micro-batch's mean counted the same
    assert not [w for rank in counted for w in rank["warnings"] if "'num_items'" in w]
    assert_same_params(merged_state(counted), reference)
    for rank in counted:
        assert rank["metrics"]["train_loss"] == pytest.approx(reference["metrics"]["train_loss"], rel=1e-5)


@pytest.mark.parametrize(
    ("world", "case"),
    [(w, c) for w, cases in {2: WORLD_2, 4: WORLD_4}.items() for c in cases],
    ids=lambda v: v if isinstance(v, int) else v["name"],
)
def test_hf_causal_lm_matches_single_process_lightning(
    world: int, case: dict[str, Any], jobs: dict, tmp_path_factory: pytest.TempPathFactory
) -> None:
    ranks = _job(world, jobs, tmp_path_factory)[case["name"]]
    assert_same_params(merged_state(ranks), reference_run(case))
    assert all(len(r["state_dict"]) > 0 for r in ranks)
    model = CausalLM(case["model"]["family"], tied=case["model"]["tied"])
    assert {r["parameters"] for r in ranks} == {sum(p.numel() for p in model.parameters())}  # a tie counts once
    if "parameters" in case["strategy"].get("offload", []):  # each decoder layer's weights came and went
        for r in ranks:
            w = r["weights"]
            assert w["checks"] > 0 and not w["not_resident"] and w["most_resident"] <= 2 and w["at_rest_on_host"], w
    if case["model"]["tied"]:  # every copy of the tied weight ended equal (merged_state checks replicas)
        embed, head = TIED_NAMES[case["model"]["family"]]
        copies = [r["state_dict"][n] for r in ranks for n in (embed, head) if n in r["state_dict"]]
        assert len(copies) >= 2 and all(torch.equal(c, copies[0]) for c in copies)


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


def _tied_phase(name: str, layout: str, steps: int, run: str, snapshots: str | None = None) -> dict[str, Any]:
    case = hf_scenario("gpt2", layout, "1F1B", tied=True, trainer={"max_steps": steps})
    case["name"] = name
    case["spot_checkpoint"] = {"dirpath": run, "every_n_train_steps": 2, "snapshots": snapshots is not None}
    if snapshots is not None:  # a snapshot every step; the durable checkpoint of step 2 is made of step 2's
        case["spot_checkpoint"].update(snapshot_every_n_train_steps=1, snapshot_dir=snapshots)
    return case


@pytest.mark.slow
def test_tied_weights_are_stored_once_and_resume_onto_any_layout(tmp_path_factory: pytest.TempPathFactory) -> None:
    """P2xD2 for 2 steps -> P1xD1 to step 4 (one tensor again) -> P2xD1 to step 6 = 6 uninterrupted steps.

    The first job also keeps snapshots (every step): its checkpoint of step 2 is made of the snapshot files
    (kind "shares"), the second snapshot copied into a mapped file with the parameters and optimizer state
    copied in the background, and the P1xD1 job resumes from those files onto its layout."""
    import json

    import transformers

    from lightning_spot import load_full_state_dict
    from lightning_spot.checkpoint.durable.shards import SafeReader

    tmp = tmp_path_factory.mktemp("tied-morph")
    run = str(tmp / "run")
    results = {}
    for world, layout, steps in ((4, "P2D2", 2), (1, "P1D1", 4), (2, "P2D1", 6)):
        phase = _tied_phase(f"tied-{layout}", layout, steps, run, str(tmp / "shm") if layout == "P2D2" else None)
        results[layout] = run_scenarios(world, [phase], tmp / layout, timeout=300)[phase["name"]]
    for r in results["P2D2"]:
        assert [(t["step"], t["mapped"], "changed" in t) for t in r["spot"]["snapshots"]] == [
            (1, False, False),
            (2, True, False),
        ]
    manifest = json.loads((tmp / "run" / "step-000000002" / "manifest.json").read_text())
    assert manifest["kind"] == "shares" and sorted(manifest["shares"]) == ["0", "1", "2", "3"]
    assert [r["restored_step"] for r in results["P1D1"]] == [2]
    assert {r["restored_step"] for r in results["P2D1"]} == {4}
    reference = reference_run(_tied_phase("reference", "P1D1", 6, run))
    assert_same_params(merged_state(results["P2D1"]), reference)

    embed, head = TIED_NAMES["gpt2"]
    step = tmp / "run" / "step-000000006"
    stored = set(SafeReader(str(step)).read_metadata().state_dict_metadata)
    assert f"model.{embed}" in stored and f"model.{head}" not in stored, "a tied parameter is stored once"
    assert not any(k.startswith("optimizer_0.state.model.lm_head") for k in stored)
    weights = load_full_state_dict(run)
    assert torch.equal(weights[embed], weights[head])
    original = transformers.GPT2LMHeadModel(CausalLM("gpt2", tied=True).model.config)
    original.load_state_dict({k.removeprefix("model."): v for k, v in weights.items()})  # strict: every name
    assert original.lm_head.weight is original.transformer.wte.weight  # the tie holds
    assert torch.equal(original.transformer.wte.weight, merged_state(results["P2D1"])[embed])

    # exported: a Hugging Face directory (the tied head written once, tied again by from_pretrained) and a .ckpt
    from lightning_spot.checkpoint.tools.export import export_huggingface, export_lightning

    export_huggingface(run, tmp / "hf", config=original.config, architecture="GPT2LMHeadModel")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp / "hf")
    assert exported.lm_head.weight is exported.transformer.wte.weight
    assert torch.equal(_logits(exported), _logits(original))
    export_lightning(run, tmp / "gpt2.ckpt")
    module = CausalLM.load_from_checkpoint(tmp / "gpt2.ckpt")
    assert module.hparams.tied and all(torch.equal(module.state_dict()[k], v) for k, v in weights.items())


@pytest.mark.parametrize(
    ("family", "tied", "shard"), [("llama", False, None), ("gpt2", True, "20KB")], ids=["llama", "gpt2-tied-sharded"]
)
def test_pretrained_weights_are_read_per_stage(family: str, tied: bool, shard: str | None, tmp_path: Path) -> None:
    """A save_pretrained directory, loaded pipelined: each rank reads only its stages' tensors, nobody builds
    the whole model, and the validation loss is the single-process loss of the same weights."""
    import json

    import transformers

    from tests.distributed import launch
    from tests.hf_models import token_loader

    path = tmp_path / "pretrained"
    CausalLM(family, tied=tied).model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    assert (path / "model.safetensors.index.json").is_file() == bool(shard)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        losses = [(reference(input_ids=ids, labels=ids).loss.item(), len(ids)) for (ids,) in token_loader(8, 32)]
    expected = sum(loss * n for loss, n in losses) / sum(n for _, n in losses)
    total = sum(p.numel() for p in reference.parameters())

    launch(
        2, ["tests/workers/pretrained_validate.py", str(path), str(tmp_path / "out"), "2"], log_dir=tmp_path / "logs"
    )
    ranks = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in range(2)]
    in_file = set(transformers.AutoModelForCausalLM.from_pretrained(path).state_dict())
    for rank in ranks:
        assert rank["val_loss"] == pytest.approx(expected, abs=1e-5)
        assert sorted(rank["reads"]) == sorted(set(rank["reads"])), "each tensor read once"
        assert len(rank["reads"]) == len(rank["local"]), "exactly this rank's tensors were read"
        assert set(rank["reads"]) <= in_file
        assert rank["parameters"] < total, "no rank holds the whole model"
    if not tied:
        assert set(ranks[0]["reads"]).isdisjoint(ranks[1]["reads"]), "the stages read disjoint tensors"


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=token_dataset(4).tensors[0]).logits


def test_export_to_hugging_face_and_lightning_formats(jobs: dict, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A Llama trained on P4xD1 -> a Hugging Face directory (sharded) that from_pretrained loads with the trained
    pipeline's logits; a contract model whose checkpoint is made of snapshot files -> one .ckpt that
    load_from_checkpoint reads with the trained weights; each read one stored file at a time."""
    import transformers

    from lightning_spot.checkpoint.tools.export import export_huggingface, export_lightning
    from lightning_spot.cli import main
    from tests.models import TinyPipelineModel

    results = _job(4, jobs, tmp_path_factory)
    runs, out = jobs["runs4"], tmp_path_factory.mktemp("exports")
    trained = CausalLM("llama")
    trained.load_state_dict(merged_state(results[LLAMA_P4["name"]]))
    info = export_huggingface(str(runs / "llama"), out / "llama", max_shard_size="20KB")  # the recorded config
    assert info["step"] == 4 and len(info["files"]) > 1 and (out / "llama" / "model.safetensors.index.json").is_file()
    largest = max(p.stat().st_size for p in (runs / "llama" / "step-000000004").glob("*.distcp"))
    assert info["peak_bytes"] <= largest + 20_000, "one stored file's tensors and one output shard at a time"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out / "llama")
    assert torch.equal(_logits(loaded), _logits(trained.model))

    assert main(["checkpoint", "export", str(runs / "tiny"), str(out / "tiny.ckpt")]) == 0
    module = TinyPipelineModel.load_from_checkpoint(out / "tiny.ckpt")  # no strategy, no lightning-spot needed
    weights = merged_state(results["tiny-P2D2-snapshot-shares"])
    assert sorted(module.state_dict()) == sorted(weights)
    assert all(torch.equal(module.state_dict()[k], v) for k, v in weights.items())
    assert json.loads((runs / "tiny" / "step-000000004" / "manifest.json").read_text())["kind"] == "shares"
    assert export_lightning(str(runs / "tiny"), out / "again.ckpt")["peak_bytes"] < sum(
        t.numel() * t.element_size() for t in weights.values()
    ), "no process holds the whole model"


@pytest.mark.parametrize("world", [4, 2])
def test_generate_outside_steps_gives_every_rank_one_process_s_tokens(
    world: int, jobs: dict, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``self.model.generate`` at each validation's end (greedy) and after fit (sampled, seeded alike), on every rank
    of a model split into stages: each rank runs its own layers, the hidden state goes from stage to stage and the
    head's logits reach every rank. Every rank gets the tokens one process generates with the same weights (the key-
    value cache on; a V-shaped pipeline whose first rank holds the first and the last stage, for world 2)."""
    case = SAMPLING[world]
    ranks = _job(world, jobs, tmp_path_factory)[case["name"]]
    reference = reference_run(case)
    assert_same_params(merged_state(ranks), reference)
    samples = reference["samples"]  # (the sanity check's validation, then one every two steps)
    assert len(samples) == 3 and samples[0] != samples[2], "training changed what the model writes"
    for rank in ranks:
        assert rank["samples"] == reference["samples"]
        assert rank["generate"] == reference["generate"]


@pytest.mark.skipif(not find_spec("peft"), reason="peft is not installed")
def test_lora_adapters_train_as_in_one_process_and_export_for_peft(
    jobs: dict, tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture
) -> None:
    """peft LoRA on a Llama, P2xD2, fine-tuned on padded batches with masked labels: adapters and frozen base end as
    one process's; the checkpoint records the base model's class and config and the adapter's; `export --peft` reads
    only the adapter tensors and writes what `PeftModel.from_pretrained` loads with the trained pipeline's logits;
    `export --hf` writes the merged model."""
    import transformers
    from peft import PeftModel

    from lightning_spot.checkpoint.tools.export import export_huggingface
    from lightning_spot.cli import main
    from tests.hf_models import LoRA

    ranks = _job(4, jobs, tmp_path_factory)[LORA["name"]]
    assert_same_params(merged_state(ranks), reference_run(LORA))
    trained = LoRA("llama")
    trained.load_state_dict(merged_state(ranks))
    run, out = jobs["runs4"] / "lora", tmp_path_factory.mktemp("lora")
    recorded = json.loads((run / "step-000000004" / "manifest.json").read_text())["pretrained"]
    assert [(p, r["kind"], r["class"], list(r["adapters"])) for p, r in recorded.items()] == [
        ("model.", "peft", "LlamaForCausalLM", ["default"])
    ]

    assert main(["checkpoint", "export", str(run), str(out / "adapter"), "--peft"]) == 0
    assert "wrote adapter 'default' of step 4" in capsys.readouterr().out
    assert sorted(p.name for p in (out / "adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    loaded = PeftModel.from_pretrained(FineTune("llama").model, out / "adapter")  # (the base training started from)
    assert torch.equal(_logits(loaded), _logits(trained.model))
    assert not torch.equal(_logits(LoRA("llama").model), _logits(trained.model)), "training moved the adapters"
    adapter_tensors = sum(p.requires_grad for p in trained.parameters())
    assert export_peft(str(run), out / "again")["tensors"] == adapter_tensors == 16, "adapter tensors only"

    # --hf: the base model with the adapter merged in, as peft's merge_and_unload gives it, for from_pretrained
    export_huggingface(str(run), out / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(out / "merged")
    assert type(merged).__name__ == "LlamaForCausalLM"
    assert torch.equal(_logits(merged), _logits(loaded.merge_and_unload()))
    assert torch.allclose(_logits(merged), _logits(trained.model), atol=1e-5)
