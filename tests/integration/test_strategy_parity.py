"""spot_pipeline trains like plain single-process Lightning, for many layouts and schedules.

Each world size runs as one real multi-process job (CPU, gloo); every scenario inside it is then
compared with a single-process Lightning run on the same data: parameters within 1e-5.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from tests.parity import assert_same_params, merged_state, reference_run, run_scenarios, shared_job

BASE: dict[str, Any] = {"loader": {"batch_size": 16, "n": 64}, "trainer": {"max_steps": 4}}


def scenario(name: str, **overrides: Any) -> dict[str, Any]:
    s = {**BASE, "name": name, **overrides}
    s["trainer"] = {**BASE["trainer"], **overrides.get("trainer", {})}
    return s


#: torchmetrics objects in the plain shapes users write (no validation_step, no validation loader, no logger or
#: checkpointing unless said): max_steps inside an epoch of 8 batches; at an epoch's end whose short last batch gives
#: micro-batches of one sample (R^2 of one sample cannot be computed); max_epochs on a V-shaped pipeline (rank 0 holds
#: the last stage, with the metrics), with a logger and ModelCheckpoint; validation metrics logged every 3 steps with
#: a logger
METRIC_SHAPES = [
    scenario(
        f"P2D2-metrics-{name}",
        strategy={"pipeline_stages": 2, "microbatches": 2, **strategy},
        model={"cls": cls},
        loader={"batch_size": 8, "n": n},
        trainer=trainer,
        **extra,
    )
    for name, cls, strategy, n, trainer, extra in (
        ("no-validation-inside-epoch", "TrainMetricModel", {}, 64, {"max_steps": 6}, {}),
        ("no-validation-epoch-end-short-batch", "TrainMetricModel", {}, 60, {"max_steps": 8}, {}),
        (
            "ZBV-max-epochs-logger-checkpoint",
            "TrainMetricModel",
            {"schedule": "ZBVZeroBubble"},
            60,
            {"max_steps": -1, "max_epochs": 2},
            {"logger": True, "checkpoint": True},
        ),
        (
            "validation-every-3-steps-logger",
            "MetricModel",
            {},
            64,
            {"max_steps": 7, "val_check_interval": 3, "limit_val_batches": None},
            {"logger": True, "val_loader": {"batch_size": 12, "n": 36}},
        ),
    )
]

WORLD_4 = [
    scenario("P2D2-1F1B-adam", strategy={"pipeline_stages": 2, "microbatches": 4, "schedule": "1F1B"}),
    # the user's own DistributedSampler, made for 4 processes (each rank read its quarter: the stages of a pipeline
    # read different rows): the whole dataset in its order, two epochs (set_epoch reshuffles it)
    # trainer.should_stop set inside the step, after the forward, by one replica's last stage only (its rows
    # hold the target that triggers it): every rank stops after that step, validates, and ends fit (the others
    # went on to the next step, and the run ended with a lost peer)
    scenario(
        "P2D2-should_stop-set-in-step-by-one-replica",
        strategy={"pipeline_stages": 2, "microbatches": 2},
        model={"cls": "StoppingModel", "optimizer": "sgd"},
        val_loader={"batch_size": 12, "n": 36},
        trainer={"max_steps": -1, "max_epochs": 2, "limit_val_batches": None},
    ),
    # the same set by validation_step (its last stage only): training ends after that validation
    scenario(
        "P2D2-should_stop-set-in-validation-step",
        strategy={"pipeline_stages": 2, "microbatches": 2},
        model={"cls": "StoppingModel", "stop_in": "validation", "optimizer": "sgd"},
        val_loader={"batch_size": 12, "n": 36},
        trainer={"max_steps": -1, "max_epochs": 2, "limit_val_batches": None, "val_check_interval": 2},
    ),
    scenario(
        "P2D2-user-DistributedSampler-2-epochs",
        strategy={"pipeline_stages": 2, "microbatches": 2},
        model={"optimizer": "sgd"},
        loader={"batch_size": 16, "n": 64, "user_sampler": True},
        trainer={"max_steps": -1, "max_epochs": 2},
    ),
    # a step that runs the model twice (two views of the batch, a loss coupling them), validation too: each stage
    # sends both passes' activations at once (before, the second pass was refused as a misplaced module)
    scenario(
        "P2D2-two-passes-per-step",
        strategy={"pipeline_stages": 2, "microbatches": 2},
        model={"cls": "TwoPassModel", "optimizer": "sgd"},
        val_loader={"batch_size": 12, "n": 36},
        trainer={"max_steps": 4, "limit_val_batches": None, "val_check_interval": 2},
    ),
    # a frozen teacher run before the model's forward, its output used by the loss only: placed on the last stage
    # (it stands in on the first); before, the last stage computed the loss with a constant stand-in for it
    scenario(
        "P2D2-distillation-teacher-run-first",
        strategy={"pipeline_stages": 2, "microbatches": 2},
        model={"cls": "DistilledModel", "optimizer": "sgd"},
    ),
    # torch's nn.TransformerEncoder with a causal mask, a position table set directly on the module (used before
    # the layers) and a temperature (after them): the later stage failed on the table (a meta tensor) and the
    # encoder's reads of its first layer, which that stage does not hold
    scenario(
        "P2D2-nn-TransformerEncoder-loose-parameters",
        strategy={"pipeline_stages": 2, "microbatches": 2},
        model={"cls": "EncoderModel"},
        val_loader={"batch_size": 12, "n": 36},
        trainer={"max_steps": -1, "max_epochs": 1, "limit_val_batches": None, "val_check_interval": 2},
        checkpoint=True,
    ),
    # ... resumed on four stages (the temperature with the last, the table with the first) from the checkpoint of its
    # last validation, which Lightning takes as one made inside the epoch (the reference: its own resume)
    scenario(
        "P4D1-nn-TransformerEncoder-resumed-from-P2D2",
        strategy={"pipeline_stages": 4, "microbatches": 4},
        model={"cls": "EncoderModel"},
        val_loader={"batch_size": 12, "n": 36},
        trainer={"max_steps": -1, "max_epochs": 2, "limit_val_batches": None, "val_check_interval": 2},
        resume={"from": "P2D2-nn-TransformerEncoder-loose-parameters", "file": "epoch=0-step=4.ckpt"},
        reference_resume={"max_epochs": 1, "file": "epoch=0-step=4.ckpt"},
    ),
    scenario(
        "P2D2-GPipe-sgd",
        strategy={"pipeline_stages": 2, "microbatches": 2, "schedule": "gpipe"},
        model={"optimizer": "sgd"},
    ),
    scenario(
        "P2D2-Interleaved1F1B-sgd",
        strategy={"pipeline_stages": 2, "microbatches": 4, "schedule": "Interleaved1F1B"},
        model={"optimizer": "sgd"},
    ),
    scenario(
        "P2D2-ZBVZeroBubble-adam", strategy={"pipeline_stages": 2, "microbatches": 4, "schedule": "ZBVZeroBubble"}
    ),
    scenario("P4D1-1F1B-adam", strategy={"pipeline_stages": 4, "microbatches": 4, "schedule": "1f1b"}),
    scenario(
        "P2D2-clip-accumulate-lr-scheduler-shuffle",
        strategy={"pipeline_stages": 2, "microbatches": 2},
        model={"scheduler": True, "optimizer": "sgd"},
        loader={"batch_size": 8, "n": 48, "shuffle": True},
        trainer={"max_steps": 8, "gradient_clip_val": 0.05, "accumulate_grad_batches": 2},
    ),
    # batches Lightning accumulates: the replicas average the gradients once, at the third batch (DDP averaged
    # every batch's before); DDP's buckets counted per batch
    scenario(
        "P2D2-accumulate-3-averaged-at-the-last-batch",
        strategy={"pipeline_stages": 2, "microbatches": 2},
        model={"optimizer": "sgd"},
        loader={"batch_size": 8, "n": 96},
        trainer={"max_steps": 4, "accumulate_grad_batches": 3, "gradient_clip_val": 0.05},
        count_reductions=True,
    ),
    # ... with a schedule that splits the backward (its average after the schedule, not DDP's), Adam
    scenario(
        "P2D2-ZBVZeroBubble-accumulate-3",
        strategy={"pipeline_stages": 2, "microbatches": 4, "schedule": "ZBVZeroBubble"},
        loader={"batch_size": 16, "n": 96},
        trainer={"max_steps": 2, "accumulate_grad_batches": 3},
    ),
    scenario(
        "P2D2-validation-test-predict",
        strategy={"pipeline_stages": 2, "microbatches": 2},
        val_loader={"batch_size": 12, "n": 36},
        eval_loader={"batch_size": 10, "n": 30},
        trainer={"max_steps": 4, "limit_val_batches": None, "val_check_interval": 2},
        after=["validate", "test", "predict"],
        writer=True,
    ),
    scenario("P2D2-meta-init", strategy={"pipeline_stages": 2, "microbatches": 2}, model={"meta_init": True}),
    # fp16 with one loss scale (from 256: no overflow of its own, in one process either): normal steps, then an
    # inf in one gradient of one stage of one replica at step 2 (every rank skips that step and halves the scale),
    # with clipping after the unscale
    scenario("P2D2-fp16-mixed", strategy={"pipeline_stages": 2, "microbatches": 2}, fp16=256),
    scenario(
        "P2D2-fp16-mixed-overflow-clip",
        strategy={"pipeline_stages": 2, "microbatches": 2},
        fp16=256,
        overflow={"param": "layers.3.fc.weight", "step": 2, "replica": 1},
        trainer={"max_steps": 5, "gradient_clip_val": 0.5},
        checkpoint={"every_n_train_steps": 3},
    ),
    # ... resumed from its step 3 onto four stages: the loss scale (halved at step 2) comes back with the rest
    scenario(
        "P4D1-fp16-mixed-resumed-after-overflow",
        strategy={"pipeline_stages": 4, "microbatches": 4},
        fp16=256,
        overflow={"param": "layers.3.fc.weight", "step": 2, "replica": 1},
        trainer={"max_steps": 5, "gradient_clip_val": 0.5},
        resume={"from": "P2D2-fp16-mixed-overflow-clip", "file": "epoch=0-step=3.ckpt"},
    ),
    # torchmetrics objects logged on steps and epochs, and a ModelCheckpoint monitoring one (3 epochs of 4 steps;
    # keeping the lowest R^2, not the last epoch's, so that the choice rests on every epoch's value)
    scenario(
        "P2D2-torchmetrics",
        strategy={"pipeline_stages": 2, "microbatches": 2},
        model={"cls": "MetricModel"},
        val_loader={"batch_size": 12, "n": 36},
        trainer={"max_steps": -1, "max_epochs": 3, "limit_val_batches": None},
        checkpoint={"monitor": "val_r2", "mode": "min"},
    ),
    *METRIC_SHAPES,
    # cost-balanced cuts: the expensive first layer gets a stage of its own
    scenario(
        "P2D2-balanced-cuts-uneven-layers",
        strategy={"pipeline_stages": 2, "microbatches": 2, "partition": "balanced", "profile_cache": None},
        model={"cls": "UnevenPipelineModel", "lr": 0.01},
        expect_cuts=[1],
    ),
    # everything "auto": the planner must pipeline a model that does not fit one device's memory
    scenario(
        "auto-planned-tight-memory", strategy={"device_memory": "14KB", "profile_cache": None}, expect_min_stages=2
    ),
    # Lightning's own ModelCheckpoint writes sharded checkpoints; fit(ckpt_path=...) resumes on another layout
    scenario(
        "P2D2-ModelCheckpoint-epoch1",
        strategy={"pipeline_stages": 2, "microbatches": 2},
        trainer={"max_steps": -1, "max_epochs": 1},
        checkpoint=True,
    ),
    scenario(
        "P4D1-resume-from-P2D2-epoch2",
        strategy={"pipeline_stages": 4, "microbatches": 4, "schedule": "gpipe"},
        trainer={"max_steps": -1, "max_epochs": 2},
        resume={"from": "P2D2-ModelCheckpoint-epoch1", "file": "epoch=0-step=4.ckpt"},
    ),
    # Lightning's EMAWeightAveraging with a weight tied across stages: validation runs on the average, the checkpoint
    # holds the average as the model and the weights being trained beside it (current_model_state); resumed onto four
    # stages, training goes on from the trained weights and the average (the model after fit: the average)
    scenario(
        "P2D2-EMA-tied-checkpoint-step-3",
        strategy={"pipeline_stages": 2, "microbatches": 2},
        model={"cls": "TiedEmbeddingModel"},
        ema=0.5,
        val_loader={"batch_size": 12, "n": 36},
        trainer={"max_steps": 3, "limit_val_batches": None, "val_check_interval": 2},
        checkpoint={"every_n_train_steps": 3},
    ),
    scenario(
        "P4D1-EMA-tied-resumed-from-P2D2",
        strategy={"pipeline_stages": 4, "microbatches": 4},
        model={"cls": "TiedEmbeddingModel"},
        ema=0.5,
        val_loader={"batch_size": 12, "n": 36},
        trainer={"max_steps": 6, "limit_val_batches": None, "val_check_interval": 2},
        resume={"from": "P2D2-EMA-tied-checkpoint-step-3", "file": "epoch=0-step=3.ckpt"},
    ),
    # Lightning's BackboneFinetuning: the backbone (on the first stage only) frozen at setup, unfrozen at the second
    # epoch into a parameter group of its own (empty on the ranks without it), whose learning rate then grows; its
    # gradients are averaged over the replicas although DDP was set up without it
    scenario(
        "P2D2-BackboneFinetuning",
        strategy={"pipeline_stages": 2, "microbatches": 2},
        model={"cls": "BackboneModel"},
        finetune={"unfreeze_backbone_at_epoch": 1},
        loader={"batch_size": 16, "n": 32},
        trainer={"max_steps": -1, "max_epochs": 4},
        checkpoint={"every_n_epochs": 1},
    ),
    # ... resumed on four stages from its third epoch: the saved groups (rank 0's names) rebuilt on every rank, as
    # Lightning's own resume does in one process (which is not the uninterrupted run's math: the reference)
    scenario(
        "P4D1-BackboneFinetuning-resumed",
        strategy={"pipeline_stages": 4, "microbatches": 4},
        model={"cls": "BackboneModel"},
        finetune={"unfreeze_backbone_at_epoch": 1},
        loader={"batch_size": 16, "n": 32},
        trainer={"max_steps": -1, "max_epochs": 4},
        resume={"from": "P2D2-BackboneFinetuning", "file": "epoch=2-step=6.ckpt"},
        reference_resume={"max_epochs": 3, "file": "epoch=2-step=6.ckpt"},
    ),
    # Lightning's StochasticWeightAveraging keeps its average in its callback state: a copy of each rank's stages,
    # resumed onto four stages in the middle of the averaging (epochs from the second on)
    scenario(
        "P2D2-SWA-checkpoint-epoch-3",
        strategy={"pipeline_stages": 2, "microbatches": 2},
        swa={"swa_lrs": 0.01, "swa_epoch_start": 2},
        loader={"batch_size": 16, "n": 32},
        trainer={"max_steps": -1, "max_epochs": 3},
        checkpoint={"every_n_epochs": 1},
    ),
    scenario(
        "P4D1-SWA-resumed-from-P2D2",
        strategy={"pipeline_stages": 4, "microbatches": 4},
        swa={"swa_lrs": 0.01, "swa_epoch_start": 2},
        loader={"batch_size": 16, "n": 32},
        trainer={"max_steps": -1, "max_epochs": 4},
        resume={"from": "P2D2-SWA-checkpoint-epoch-3", "file": "epoch=2-step=6.ckpt"},
    ),
    # mid-epoch, shuffled: the resumed run continues exactly where the global batch sequence stopped
    scenario(
        "P2D2-ModelCheckpoint-every-3-steps-shuffled",
        strategy={"pipeline_stages": 2, "microbatches": 2},
        loader={"batch_size": 16, "n": 80, "shuffle": True},
        trainer={"max_steps": 3},
        checkpoint={"every_n_train_steps": 3},
    ),
    scenario(
        "P1D4-resume-mid-epoch-through-epoch-2",
        strategy={"pipeline_stages": 1, "microbatches": 1},
        loader={"batch_size": 16, "n": 80, "shuffle": True},
        trainer={"max_steps": -1, "max_epochs": 2},
        resume={"from": "P2D2-ModelCheckpoint-every-3-steps-shuffled", "file": "epoch=0-step=3.ckpt"},
    ),
]
WORLD_2 = [
    scenario("P2D1-1F1B-sgd", strategy={"pipeline_stages": 2, "microbatches": 4}, model={"optimizer": "sgd"}),
    scenario("P1D2-GPipe-adam", strategy={"pipeline_stages": 1, "microbatches": 2, "schedule": "GPipe"}),
    scenario(
        "P2D1-InterleavedZeroBubble-adam",
        strategy={"pipeline_stages": 2, "microbatches": 4, "schedule": "InterleavedZeroBubble"},
    ),
    scenario(
        "P2D1-DualPipeV-sgd",
        strategy={"pipeline_stages": 2, "microbatches": 4, "schedule": "DualPipeV"},
        model={"optimizer": "sgd"},
    ),
    # streamed weights on one pipeline rank, two stages: the last stage's gradient average is in flight while the
    # first stage's backward runs; the tied embedding's copies (one per stage) are summed after the schedule
    scenario(
        "P1D2-offload-parameters-LoopedBFS-tied",
        strategy={"pipeline_stages": 1, "microbatches": 2, "offload": "parameters", "layers": "layers"},
        model={"cls": "TiedEmbeddingModel", "num_layers": 2},
    ),
    # validation too: torch hands (empty) backward outputs between the rank's adjacent stages even then
    scenario(
        "P1D2-LoopedBFS-adam-validation",
        strategy={"pipeline_stages": 1, "microbatches": 2, "schedule": "loopedbfs"},
        val_loader={"batch_size": 12, "n": 36},
        trainer={"max_steps": 4, "limit_val_batches": None, "val_check_interval": 2},
    ),
    # trainer.fit(torch.compile(model)) as Lightning's docs write it (Lightning refused the strategy): each stage's
    # layers are compiled (aot_eager: dynamo and AOT autograd without a C++ build), training and validation
    scenario(
        "P2D1-torch-compile",
        strategy={"pipeline_stages": 2, "microbatches": 2},
        model={"optimizer": "sgd"},
        compile="aot_eager",
        val_loader={"batch_size": 12, "n": 36},
        trainer={"max_steps": 4, "limit_val_batches": None, "val_check_interval": 2},
    ),
    # blocks compiled one by one by the user: the compiled wrapper's forward was taken for the block's (torch's
    # placeholder), and the layers of the other stage read their activation argument by that placeholder's signature
    scenario(
        "P2D1-blocks-compiled-by-the-user",
        strategy={"pipeline_stages": 2, "microbatches": 2},
        model={"cls": "CompiledBlocksModel", "optimizer": "sgd"},
        compile=None,
    ),
    # one block at all four places: each stage ran its copy once per place (the stage took its two places for two
    # passes of the step, and refused it)
    scenario(
        "P2D1-one-block-at-every-place",
        strategy={"pipeline_stages": 2, "microbatches": 2},
        model={"cls": "SharedBlockModel", "optimizer": "sgd"},
    ),
    # blocks under the user's own torch.utils.checkpoint: its recomputation in the backward ran each stage's first
    # block on the stand-in it was given, not on the previous stage's output (torch: a different number of tensors)
    scenario(
        "P2D1-user-checkpoint-per-block",
        strategy={"pipeline_stages": 2, "microbatches": 2},
        model={"cls": "CheckpointedModel", "optimizer": "sgd"},
    ),
    scenario(
        "P2D1-loss-hook-dict-batches",
        strategy={"pipeline_stages": 2, "microbatches": 2},
        model={"cls": "LossHookModel"},
        loader={"batch_size": 16, "n": 64, "dict_batches": True},
    ),
    scenario(
        "P2D1-bf16-mixed",
        strategy={"pipeline_stages": 2, "microbatches": 4},
        trainer={"precision": "bf16-mixed"},
    ),
    scenario(
        "P2D1-offload-activations-bf16-mixed",
        strategy={"pipeline_stages": 2, "microbatches": 4, "offload": "activations"},
        trainer={"precision": "bf16-mixed"},
    ),
]
# batches in containers that torch's pytree takes for leaves: a tokenizer's BatchEncoding (transformers' collators) and
# a dataclass, cut into micro-batches like dicts (they had "no tensor to split")
WORLD_2 += [
    scenario(
        f"P2D1-{kind}-batches-validation",
        strategy={"pipeline_stages": 2, "microbatches": 2},
        model={"cls": "ContainerBatchModel"},
        loader={"batch_size": 16, "n": 64, "container": kind},
        val_loader={"batch_size": 12, "n": 36, "container": kind},
        trainer={"max_steps": 4, "limit_val_batches": None, "val_check_interval": 2},
    )
    for kind in ("BatchEncoding", "dataclass")
]
# random draws in data loading (a WeightedRandomSampler, crops drawn in __getitem__ from torch, random and NumPy):
# every stage draws alike (each stage drew its own: the first forwarded one sample, the last took another's target)
WORLD_2 += [
    scenario(
        "P2D1-random-crops-weighted-sampler",
        strategy={"pipeline_stages": 2, "microbatches": 2},
        loader={"batch_size": 16, "n": 64, "random_draws": True},
        trainer={"max_steps": -1, "max_epochs": 2},
    )
]
# random draws in the step (a diffusion model's noise, drawn before the forward and the target after it) and in the
# batch transfer hooks (augmentations): the same on every stage, so the pipeline trains as spot_pipeline on one
# process with the same micro-batches (plain Lightning draws the noise for the whole batch at once)
WORLD_2 += [
    scenario(
        "P2D1-noise-drawn-in-step-and-transfer-hooks",
        strategy={"pipeline_stages": 2, "microbatches": 2},
        model={"cls": "NoisyStepModel", "optimizer": "sgd"},
        trainer={"max_steps": 8},
        reference="P1",
    ),
    # the same with Python's random and NumPy (the step's scale and noise, a coin in on_after_batch_transfer)
    scenario(
        "P2D1-python-and-numpy-draws-in-step-and-hook",
        strategy={"pipeline_stages": 2, "microbatches": 2},
        model={"cls": "PythonDrawsModel", "optimizer": "sgd"},
        trainer={"max_steps": 8},
        reference="P1",
    ),
    # noise drawn between two passes of the step through the model, the second pass's input and its target: drawn
    # alike on both stages (the first stage needs it for the input, the last for the loss)
    scenario(
        "P2D1-noise-drawn-between-two-passes",
        strategy={"pipeline_stages": 2, "microbatches": 2},
        model={"cls": "TwoPassModel", "noise": True, "optimizer": "sgd"},
        trainer={"max_steps": 8},
        reference="P1",
    ),
]
# offload="optimizer": fp32 masters and optimizer state in host memory, the update there; the same math
WORLD_2 += [
    scenario(
        "P2D1-offload-optimizer-clip",
        strategy={"pipeline_stages": 2, "microbatches": 2, "offload": "optimizer"},
        trainer={"max_steps": 4, "gradient_clip_val": 0.05},
    ),
    # the planner offloads because nothing else fits 16000 bytes per process (without: 21 KB for the first stage)
    scenario(
        "P2D1-offload-auto-tight-memory",
        strategy={
            "pipeline_stages": 2,
            "microbatches": 2,
            "offload": "auto",
            "device_memory": 16000,
            "activation_checkpointing": False,
            "profile_cache": None,
        },
        expect_offload="optimizer",
    ),
    scenario(
        "P2D1-offload-activations-clip",
        strategy={"pipeline_stages": 2, "microbatches": 2, "offload": "activations"},
        trainer={"max_steps": 4, "gradient_clip_val": 0.05},
    ),
    # offload="parameters" (Harmony): a stage's weights on the device only while it computes; by default
    # breadth-first (LoopedBFS) with one layer per stage; validation streams the weights too
    scenario(
        "P2D1-offload-parameters-defaults-clip-validation",
        strategy={"pipeline_stages": 2, "microbatches": 4, "offload": "parameters"},
        val_loader={"batch_size": 12, "n": 36},
        trainer={"max_steps": 4, "gradient_clip_val": 0.05, "limit_val_batches": None, "val_check_interval": 2},
    ),
    # EMAWeightAveraging with the weights streamed from host memory: the average is kept there, swapped in for
    # validation (into the host masters) and copied in at the end
    scenario(
        "P2D1-offload-parameters-EMA-validation",
        strategy={"pipeline_stages": 2, "microbatches": 4, "offload": "parameters"},
        ema=0.7,
        val_loader={"batch_size": 12, "n": 36},
        trainer={"max_steps": 4, "limit_val_batches": None, "val_check_interval": 2},
    ),
    # offload="auto" streams the weights when nothing else fits: 8 layers of 64 x 64 in 120 KB per process
    # (the optimizer and activation levels together need ~150 KB). SGD with momentum (state to offload): Adam
    # turns the rounding of a different micro-batch sum into >1e-5 after 4 steps on some CPUs (2.6e-5 seen)
    scenario(
        "auto-offload-streams-weights-tight-memory",
        strategy={"pipeline_stages": 2, "offload": "auto", "device_memory": "120KB", "profile_cache": None},
        model={"num_layers": 8, "width": 64, "optimizer": "sgd"},
        expect_offload="parameters",
    ),
    # bf16 weights on the device, fp32 masters on the host: SGD's small updates are not rounded away, so the
    # run follows fp32 training (within bf16's tolerance for the forward and backward)
    scenario(
        "P2D1-offload-optimizer-bf16-true-sgd",
        strategy={"pipeline_stages": 2, "microbatches": 2, "offload": "optimizer"},
        model={"optimizer": "sgd"},
        trainer={"max_steps": 4, "precision": "bf16-true"},
    ),
    scenario(
        "P2D1-offload-parameters-bf16-true-sgd",
        strategy={"pipeline_stages": 2, "microbatches": 2, "offload": "parameters"},
        model={"optimizer": "sgd"},
        trainer={"max_steps": 4, "precision": "bf16-true"},
    ),
]
WORLD_4 += [
    scenario(
        "P2D2-offload-activations",
        strategy={"pipeline_stages": 2, "microbatches": 2, "offload": "activations"},
    ),
    scenario(
        "P2D2-offload-parameters-and-activations-LoopedBFS-clip-tied",
        strategy={
            "pipeline_stages": 2,
            "microbatches": 2,
            "schedule": "LoopedBFS",
            "stages_per_rank": 2,
            "offload": ["parameters", "activations"],
        },
        model={"cls": "TiedEmbeddingModel"},
        trainer={"max_steps": 4, "gradient_clip_val": 0.05},
    ),
    # every level at once resumes from a checkpoint written without offload; 1F1B: one stage per rank, streamed
    # all the same
    scenario(
        "P2D2-offload-all-levels-resume-from-P2D2-epoch1",
        strategy={"pipeline_stages": 2, "microbatches": 2, "offload": ["parameters", "activations"]},
        trainer={"max_steps": -1, "max_epochs": 2},
        resume={"from": "P2D2-ModelCheckpoint-epoch1", "file": "epoch=0-step=4.ckpt"},
    ),
    scenario(
        "P2D2-offload-optimizer-and-activations-clip-tied",
        strategy={"pipeline_stages": 2, "microbatches": 2, "offload": ["optimizer", "activations"]},
        model={"cls": "TiedEmbeddingModel"},
        trainer={"max_steps": 4, "gradient_clip_val": 0.05},
    ),
]
WORLD_3 = [
    scenario("P3D1-1F1B-uneven", strategy={"pipeline_stages": 3, "microbatches": 4}, model={"num_layers": 5}),
    # gradient norms logged before each update (lightning_spot.grad_norm), a weight tied across the first and last stage
    scenario("P3D1-grad-norm-tied", strategy={"pipeline_stages": 3, "microbatches": 2}, model={"cls": "GradNormModel"}),
    # a training step that returns its predictions besides the loss, read in on_train_batch_end
    scenario(
        "P3D1-step-outputs",
        strategy={"pipeline_stages": 3, "microbatches": 4},
        model={"cls": "OutputsModel"},
        val_loader={"batch_size": 12, "n": 36},
        trainer={"max_steps": 4, "limit_val_batches": None, "val_check_interval": 2},
    ),
    # Lightning's StochasticWeightAveraging: averaged from the third of four epochs, its SWALR schedule swapped in,
    # the average copied into the model at the end
    scenario(
        "P3D1-StochasticWeightAveraging",
        strategy={"pipeline_stages": 3, "microbatches": 2},
        swa={"swa_lrs": 0.01, "swa_epoch_start": 2},
        loader={"batch_size": 16, "n": 32},
        trainer={"max_steps": -1, "max_epochs": 4},
    ),
    scenario(
        "P3D1-GPipe-explicit-cuts",
        strategy={"pipeline_stages": 3, "microbatches": 2, "schedule": "GPipe", "partition": [1, 4]},
        model={"num_layers": 5, "optimizer": "sgd"},
    ),
]
# pipelines of mixed depths: every rank trains whatever the world size (split: micro-batches per pipeline)
WORLD_3 += [
    # everything "auto" with two layers on three processes: no uniform layout fits (P3 > layers, 16 % 3), a mix does
    scenario(
        "auto-planned-mixed-two-layers",
        strategy={"profile_cache": None},
        model={"num_layers": 2},
        expect_layout="P1+P2",
    ),
    # 4 micro-batches split by measured layer times: [1, 3] or [2, 2] (timing decides)
    scenario("mixed-P1+P2-adam", strategy={"pipeline_stages": [1, 2], "microbatches": 4}),
    # EMAWeightAveraging where one pipeline holds the whole model and the other two stages: each averages its own
    scenario(
        "mixed-P1+P2-EMA-validation",
        strategy={"pipeline_stages": [1, 2], "microbatches": 4},
        ema=0.7,
        val_loader={"batch_size": 12, "n": 24},
        trainer={"max_steps": 4, "limit_val_batches": None, "val_check_interval": 2},
    ),
    scenario(
        "mixed-P1+P2-clip-sgd",
        strategy={"pipeline_stages": [1, 2], "microbatches": [2, 2]},
        model={"optimizer": "sgd"},
        trainer={"max_steps": 4, "gradient_clip_val": 0.05},
        expect_split=[2, 2],
    ),
    # fp16 across pipelines of mixed depths: the schedule divides the gradients there (not the losses); SGD, which
    # (unlike Adam) moves by the gradients' size
    scenario(
        "mixed-P1+P2-fp16-sgd",
        strategy={"pipeline_stages": [1, 2], "microbatches": [2, 2]},
        model={"optimizer": "sgd"},
        fp16=256,
        expect_split=[2, 2],
    ),
]
WORLD_4 += [
    scenario("mixed-P1+P3-adam", strategy={"pipeline_stages": [1, 3], "microbatches": 4}, expect_split=[1, 3]),
    scenario(  # (logging the gradient norms as well: only pipeline 0's ranks count there)
        "mixed-P1+P3-tied-embeddings",
        strategy={"pipeline_stages": [1, 3], "microbatches": [2, 6]},
        model={"cls": "GradNormModel"},
        expect_split=[2, 6],
    ),
]
# losses summed over the batch's samples (reduction="sum"), trained with SGD: a step's micro-batch sums add up over
# micro-batches and replicas, as one process's sum over the batch; recognised (the loss and the validation's logged
# value are what the loss function returned; past the first 8 steps, which are watched for them: remembered), and
# declared (`loss_reduction`); epochs of 5 batches of 16 rows and one of 8
SUMMED = {"batch_size": 16, "n": 88}
WORLD_4 += [
    scenario(
        "P2D2-summed-loss-validation",
        strategy={"pipeline_stages": 2, "microbatches": 2},
        model={"cls": "SummedLossModel"},
        trainer={"max_steps": 10, "limit_val_batches": None, "val_check_interval": 3},
        loader=SUMMED,
        val_loader={"batch_size": 4, "n": 36},
    ),
    scenario(
        "P4D1-summed-loss-declared-fp16",
        strategy={"pipeline_stages": 4, "microbatches": 4},
        model={"cls": "SummedLossModel", "kind": "declared"},
        fp16=256,
        loader=SUMMED,
    ),
    # not said to be a sum: taken for a mean (warned about), so not the same math: not among the parity cases
    scenario(
        "P2D2-summed-loss-undeclared",
        strategy={"pipeline_stages": 2, "microbatches": 2},
        model={"cls": "SummedLossModel", "kind": "undeclared"},
        differs=True,
        loader=SUMMED,
    ),
]
# step outputs collected in lists on the module for the epochs' ends (Lightning 2's way): every rank's lists hold what
# one process's do (one entry per step, micro-batches merged), so what is computed from them at the end is the same
# (with replicas, a replica's samples, as each DDP process's lists hold)
WORLD_4 += [
    scenario(
        "P4D1-step-outputs-collected-in-lists",
        strategy={"pipeline_stages": 4, "microbatches": 2},
        model={"cls": "CollectingModel"},
        val_loader={"batch_size": 12, "n": 36},
        trainer={"max_steps": 8, "limit_val_batches": None},
    ),
]
# Lightning's model summary with example_input_array (run through the model: it stopped the run on a later stage),
# showing the whole model's figures on every rank, with tied weights across the first and the last stage
WORLD_4 += [
    scenario(
        "P4D1-model-summary-example-input-tied",
        strategy={"pipeline_stages": 4, "microbatches": 4},
        model={"cls": "ExampleInputModel"},
        summary=True,
    ),
]
WORLD_5 = [
    scenario("mixed-P2+P3-uneven-split-3-5", strategy={"pipeline_stages": [2, 3], "microbatches": [3, 5]}),
    scenario(
        "mixed-P2+P3-clip-tied-shuffle",
        strategy={"pipeline_stages": [2, 3]},
        model={"cls": "TiedEmbeddingModel", "optimizer": "sgd"},
        loader={"batch_size": 8, "n": 48, "shuffle": True},
        trainer={"max_steps": 6, "gradient_clip_val": 0.05},
    ),
    # the expensive first layer gets a stage of its own in the depth-2 pipeline; the faster pipeline gets more
    scenario(
        "mixed-P2+P3-balanced-uneven-layers",
        strategy={"pipeline_stages": [2, 3], "microbatches": 8, "partition": "balanced", "profile_cache": None},
        model={"cls": "UnevenPipelineModel", "lr": 0.01},
        expect_cuts={2: [1]},
    ),
]
ALL = {4: WORLD_4, 2: WORLD_2, 3: WORLD_3, 5: WORLD_5}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, list[dict]]]:
    return {}


def _results(jobs: dict, world: int, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    run = lambda: run_scenarios(world, ALL[world], tmp_path_factory.mktemp(f"world{world}"))  # noqa: E731
    return shared_job(jobs, world, run)  # type: ignore[no-any-return]


CASES = [(w, s) for w, group in ALL.items() for s in group if not s.get("differs")]


@pytest.mark.parametrize(("world", "case"), CASES, ids=[s["name"] for _, s in CASES])
def test_matches_single_process_lightning(world: int, case: dict[str, Any], jobs: dict, tmp_path_factory) -> None:
    ranks = _results(jobs, world, tmp_path_factory)[case["name"]]
    initial = merged_state(ranks, "initial") if case.get("model", {}).get("meta_init") else None
    bf16 = case["trainer"].get("precision") in ("bf16-mixed", "bf16-true") or case.get("fp16", False)
    if bf16 and (
        "optimizer" in str(case["strategy"].get("offload")) or "parameters" in str(case["strategy"].get("offload"))
    ):
        # fp32 master weights: the update is that of fp32 training (only forward and backward run in bf16)
        ref = reference_run({**case, "trainer": {k: v for k, v in case["trainer"].items() if k != "precision"}})
    else:
        ref = reference_run(case, initial)
    assert_same_params(merged_state(ranks), ref, atol=5e-3 if bf16 else 1e-5)

    # every rank logs the true loss of the last step (computed on the last stage), and of the last validation
    for r in ranks:
        assert r["metrics"]["train_loss"] == pytest.approx(ref["metrics"]["train_loss"], abs=5e-3 if bf16 else 1e-5)
        if "val_loss" in ref["metrics"]:
            assert r["metrics"]["val_loss"] == pytest.approx(ref["metrics"]["val_loss"], abs=5e-3 if bf16 else 1e-5)

    # no rank holds the whole model: each holds exactly its stages' parameters, under their original names
    if ranks[0]["layout"].startswith(("P2", "P3", "P4")):
        for r in ranks:
            assert 0 < len(r["state_dict"]) < len(ref["state_dict"])

    assert all(r["inputs_kept"] == 0 for r in ranks), [r["inputs_kept"] for r in ranks]  # (kept for recomputations)
    if case.get("count_reductions"):  # none in the accumulated batches, some in each accumulation's last
        accumulate = case["trainer"]["accumulate_grad_batches"]
        for r in ranks:
            last = [n for i, n in enumerate(r["reductions"]) if i % accumulate == accumulate - 1]
            others = [n for i, n in enumerate(r["reductions"]) if i % accumulate != accumulate - 1]
            assert all(n > 0 for n in last) and not any(others), r["reductions"]
    if "compile" in case:  # every rank ran graphs of its own layers (compiled by the strategy, or by the user)
        assert all(r["compiled_graphs"] > 0 for r in ranks), [r["compiled_graphs"] for r in ranks]
    if "expect_offload" in case:
        assert all(case["expect_offload"] in r["offload_levels"] for r in ranks), [r["offload_levels"] for r in ranks]
    offload = ranks[0]["offload_levels"]
    if "activations" in offload:
        for r in ranks:  # every stage sent what its forwards saved to host memory, and got it back ahead of use
            saved = r["activation_offload"]
            assert saved["tensors"] > 0 and saved["bytes"] > 0, saved
            assert 0 < saved["prefetch_hits"] <= saved["prefetched"] <= saved["tensors"], saved
    if "optimizer" in offload:
        for r in ranks:  # the optimizer's state lives with the fp32 host masters, not next to the weights
            off = r["offload"]
            assert off["states"] > 0 and not off["state_shares_param_storage"], off
            # gradients went to the host as each stage's backward ended (the schedule went on meanwhile); those
            # changed after it (tied copies summed) were copied again: the parity above shows which was used.
            # (Streamed weights send their own gradients to the host.)
            assert off["early_copies_used"] > 0 or "parameters" in offload, off
            assert off["state_dtypes"] == ["torch.float32"] and off["master_dtypes"] == ["torch.float32"], off
            if bf16:  # (streamed weights rest on their fp32 masters; the modules beside them stay in bf16)
                want = ["torch.bfloat16", "torch.float32"] if "parameters" in offload else ["torch.bfloat16"]
                assert off["param_dtypes"] == want, off
    if "parameters" in offload:
        for r in ranks:  # from hooks: a computing stage's weights had device storage, and at most one other's
            w = r["weights"]
            assert w["checks"] > 0 and not w["not_resident"] and 1 <= w["most_resident"] <= 2, w
            assert w["at_rest_on_host"], w  # between steps every streamed weight is its host master
            if case["strategy"].get("schedule", "LoopedBFS") == "LoopedBFS":
                # a stage's weights come once for all micro-batches' forwards and once for their backwards (the
                # last stage's backward follows its forward at once): 2 x stages - 1 loads per step, whatever M
                assert set(w["loads_per_step"][1:]) == {2 * w["stages"] - 1}, w
    if "expect_layout" in case:
        assert ranks[0]["layout"] == case["expect_layout"]
    if "+" in ranks[0]["layout"]:
        _check_mixed_placement(ranks, ref["state_dict"], case.get("expect_split"))
    if isinstance(case.get("expect_cuts"), dict):  # pipeline depth -> its cuts
        depths = [int(d[1:]) for d in ranks[0]["layout"].split("+")]
        for r in ranks:
            want = case["expect_cuts"].get(depths[r["pipeline"]])
            assert want is None or r["cuts"] == want, [r["cuts"] for r in ranks]
    elif "expect_cuts" in case:
        assert all(r["cuts"] == case["expect_cuts"] for r in ranks), [r["cuts"] for r in ranks]
    if "expect_min_stages" in case:
        assert int(ranks[0]["layout"].split("xD")[0][1:]) >= case["expect_min_stages"], ranks[0]["layout"]

    if case.get("checkpoint"):
        files = ranks[0]["checkpoint_files"]
        checkpoints = [f for f in files if f.endswith(".ckpt")]
        assert checkpoints
        for ckpt in checkpoints:
            assert f"{ckpt}/.metadata" in files and f"{ckpt}/manifest.json" in files
            assert any(f.startswith(f"{ckpt}/") and f.endswith(".distcp") for f in files)

    if "val_loader" in case:  # validation during fit: the same loss
        for r in ranks:
            assert r["metrics"]["val_loss"] == pytest.approx(ref["metrics"]["val_loss"], abs=1e-5)
    if "validate" in case.get("after", []):
        for r in ranks:
            assert r["metrics"]["val_loss"] == pytest.approx(ref["metrics"]["val_loss"], abs=1e-5)
            assert r["validate"]["val_loss"] == pytest.approx(ref["validate"]["val_loss"], abs=1e-5)
            assert r["test"]["test_loss"] == pytest.approx(ref["test"]["test_loss"], abs=1e-5)
        _check_predictions(ranks, ref["predict"])


def _check_mixed_placement(ranks: list[dict], full: dict[str, torch.Tensor], split: list[int] | None) -> None:
    """Every parameter lives on exactly one rank of every pipeline; only a depth-1 pipeline holds the whole model."""
    depths = [int(d[1:]) for d in ranks[0]["layout"].split("+")]
    for name in full:
        holders = sorted(r["pipeline"] for r in ranks if name in r["state_dict"])
        assert holders == list(range(len(depths))), (name, holders)
    for r in ranks:
        assert (len(r["state_dict"]) == len(full)) == (depths[r["pipeline"]] == 1)
        # every rank starts reducing gradients during the backward, as DDP does (at least once per step)
        assert r["reduced_during_backward"] >= 4, r["reduced_during_backward"]
    if split is not None:
        assert [next(r["microbatches"] for r in ranks if r["pipeline"] == p) for p in range(len(depths))] == split


def test_clipping_and_accumulation_are_active() -> None:
    """The clip/accumulate scenario would be vacuous if clipping never triggered: prove it does."""
    case = next(s for s in WORLD_4 if s["name"].startswith("P2D2-clip"))
    with_features = reference_run(case)["state_dict"]
    for change in ({"gradient_clip_val": None}, {"accumulate_grad_batches": 1}):
        plain = reference_run({**case, "trainer": {**case["trainer"], **change}})["state_dict"]
        assert max((with_features[k] - plain[k]).abs().max().item() for k in plain) > 1e-3, change


def _check_predictions(ranks: list[dict], want: list[torch.Tensor]) -> None:
    """Each replica returns the predictions of its share of every batch, on every stage."""
    pipelines: dict[int, list[dict]] = {}
    data_parallel = int(ranks[0]["layout"].split("xD")[1])
    for rank, r in enumerate(ranks):
        pipelines.setdefault(rank % data_parallel, []).append(r)
    for batch_idx, full in enumerate(want):
        shares = []
        for dp in range(data_parallel):
            outs = [r["predict"][batch_idx] for r in pipelines[dp]]
            for o in outs[1:]:
                assert torch.equal(o, outs[0]), "all stages of a replica return the same predictions"
            shares.append(outs[0])
        torch.testing.assert_close(torch.cat(shares), full, atol=1e-5, rtol=0)


def test_meta_init_is_layout_independent(jobs: dict, tmp_path_factory) -> None:
    """Weights initialised per stage (configure_model on meta) do not depend on the layout."""
    ranks = _results(jobs, 4, tmp_path_factory)["P2D2-meta-init"]
    initial = merged_state(ranks, "initial")
    from lightning_spot.partition.cuts import plan_stages
    from lightning_spot.partition.discovery import discover
    from lightning_spot.partition.placement import place_stages
    from tests.models import MetaInitPipelineModel

    torch.manual_seed(123)  # a different global seed must not matter
    with torch.device("meta"):
        model = MetaInitPipelineModel()
        model.configure_model()
    split = discover(model)
    place_stages(model, split, plan_stages(split.num_layers, 1), pp_rank=0, device=torch.device("cpu"))
    single = model.state_dict()
    assert sorted(single) == sorted(initial)
    for k in single:
        assert torch.equal(single[k], initial[k]), k


def test_torchmetrics_objects_log_what_one_process_logs(jobs: dict, tmp_path_factory) -> None:
    """R^2 of the last step (over its micro-batches of both replicas, not their mean) and of each epoch, MSE and R^2
    of validation epochs, and a metric's ``compute()`` called by hand at the epoch's end: the values of one process
    on every rank; ModelCheckpoint keeps the same best epoch."""
    case = next(s for s in WORLD_4 if s["name"] == "P2D2-torchmetrics")
    ranks = _results(jobs, 4, tmp_path_factory)[case["name"]]
    ref = reference_run(case)
    names = ("train_r2_step", "train_r2_epoch", "val_mse", "val_r2", "val_mae")
    assert set(names) <= set(ref["metrics"])
    for r in ranks:
        for name in names:
            assert r["metrics"][name] == pytest.approx(ref["metrics"][name], rel=1e-5, abs=1e-6), name
        assert r["best_checkpoint"][0] == ref["best_checkpoint"][0] != "epoch=2-step=12.ckpt"
        assert r["best_checkpoint"][1] == pytest.approx(ref["best_checkpoint"][1], rel=1e-5)


@pytest.mark.parametrize("case", METRIC_SHAPES, ids=[s["name"] for s in METRIC_SHAPES])
def test_torchmetrics_objects_in_every_shape_users_write_log_what_one_process_logs(
    case: dict[str, Any], jobs: dict, tmp_path_factory
) -> None:
    """``self.log(name, metric, on_step=True, on_epoch=True)``: with and without validation, a logger and
    checkpointing, ``max_steps`` inside an epoch or at its end, ``max_epochs``: the run ends on every rank (no
    collective that only some enter) with the values one process logs, on steps and at every epoch's end."""
    ranks = _results(jobs, 4, tmp_path_factory)[case["name"]]
    ref = reference_run(case)
    names = [k for k in ref["metrics"] if k.startswith(("train_mse", "train_r2", "val_"))]
    assert {"train_r2_step", "train_r2_epoch"} <= set(names), names
    if case["model"]["cls"] == "TrainMetricModel":
        assert {"train_mse_step", "train_mse_epoch"} <= set(names), names
    else:
        assert {"val_mse", "val_r2", "val_mae"} <= set(names), names
    epochs = [{k: e[k] for k in names if k in e} for e in ref["epoch_metrics"]]
    assert epochs and all(epochs)
    for r in ranks:
        for name in names:
            assert r["metrics"][name] == pytest.approx(ref["metrics"][name], rel=1e-5, abs=1e-6), name
        got = [{k: e[k] for k in names if k in e} for e in r["epoch_metrics"]]
        assert len(got) == len(epochs), (got, epochs)
        for g, want in zip(got, epochs):
            assert g == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_grad_norm_logs_the_norms_of_every_stage_on_every_rank(jobs: dict, tmp_path_factory) -> None:
    """``lightning_spot.grad_norm`` in ``on_before_optimizer_step``: every rank logs the norm of every parameter of
    the model (the tied weight once, under the name one process gives it) and their total, as one process does with
    Lightning's ``grad_norm`` (which, in a pipeline, sees one stage's parameters: each rank would log its share); on
    three stages, and on pipelines of depths 1 and 3 (where only the first pipeline's ranks count)."""
    for world, name in ((3, "P3D1-grad-norm-tied"), (4, "mixed-P1+P3-tied-embeddings")):
        case = next(s for s in ALL[world] if s["name"] == name)
        ranks = _results(jobs, world, tmp_path_factory)[name]
        ref = reference_run(case)
        names = {k for k in ref["metrics"] if k.startswith("grad_")}
        assert {"grad_2.0_norm_total", "grad_inf_norm_total", "grad_2.0_norm/embed.1.weight"} <= names
        assert "grad_2.0_norm/head.0.weight" not in names  # (the tied weight's other name)
        for r in ranks:
            assert {k for k in r["metrics"] if k.startswith("grad_")} == names
            for key in names:
                assert r["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-4, abs=1e-7), (name, key)


def test_what_a_training_step_returns_besides_its_loss_reaches_every_rank_s_outputs(jobs, tmp_path_factory) -> None:
    """``return {"loss": loss, "preds": preds}`` (and ``{"preds": preds}`` from ``validation_step``): every rank's
    ``on_train_batch_end`` (``on_validation_batch_end``) gets the step's predictions, the micro-batches' rows put back
    together: one process's batch (the same rows and values)."""
    case = next(s for s in WORLD_3 if s["name"] == "P3D1-step-outputs")
    ranks = _results(jobs, 3, tmp_path_factory)[case["name"]]
    ref = reference_run(case)
    assert ref["metrics"]["preds_rows"] == 16 and ref["metrics"]["val_preds_rows"] == 12
    for r in ranks:
        assert r["metrics"]["preds_rows"] == 16 and r["metrics"]["val_preds_rows"] == 12
        for name in ("preds_mean", "val_preds_mean"):
            assert r["metrics"][name] == pytest.approx(ref["metrics"][name], rel=1e-5, abs=1e-7), name


def test_ema_weight_averaging_validates_and_resumes_like_one_process(jobs: dict, tmp_path_factory) -> None:
    """Lightning's EMAWeightAveraging: validation on the average gives one process's value on every rank, before and
    after a resume onto another layout (where a checkpoint that lost the trained weights would resume from the
    average and drift); the checkpoint keeps the trained weights as a copy of the model's state, not in JSON."""
    results = _results(jobs, 4, tmp_path_factory)
    for name in ("P2D2-EMA-tied-checkpoint-step-3", "P4D1-EMA-tied-resumed-from-P2D2"):
        case = next(s for s in WORLD_4 if s["name"] == name)
        ref = reference_run(case)
        for r in results[name]:
            assert r["metrics"]["val_loss"] == pytest.approx(ref["metrics"]["val_loss"], abs=1e-5), name
    assert {r["restored_step"] for r in results["P4D1-EMA-tied-resumed-from-P2D2"]} == {3}
    files = results["P2D2-EMA-tied-checkpoint-step-3"][0]["checkpoint_files"]
    manifest_path = next(f for f in files if f.endswith("manifest.json"))
    root = tmp_path_factory.getbasetemp()
    manifest = json.loads(next(root.rglob(f"P2D2-EMA-tied-checkpoint-step-3/ckpts/{manifest_path}")).read_text())
    assert manifest["lightning"]["current_model_state"] == {"__model_copy__": True}
    assert set(manifest["lightning"]["averaging_state"]) == {"n_averaged"}


def test_fp16_agrees_on_one_loss_scale(jobs: dict, tmp_path_factory) -> None:
    """Every rank ends with the scale of one process: the same on all, halved once by the injected overflow (which
    only one stage of one replica saw), and the skipped step skipped everywhere (the parameters match)."""
    results = _results(jobs, 4, tmp_path_factory)
    plain, overflow = results["P2D2-fp16-mixed"], results["P2D2-fp16-mixed-overflow-clip"]
    assert {r["scaler"] for r in plain + overflow} == {"ShardedGradScaler"}
    assert {r["loss_scale"] for r in plain} == {256.0}
    ref = reference_run(next(s for s in WORLD_4 if s["name"] == "P2D2-fp16-mixed-overflow-clip"))
    assert ref["loss_scale"] == 128.0
    assert {r["loss_scale"] for r in overflow} == {128.0}
    resumed = results["P4D1-fp16-mixed-resumed-after-overflow"]  # (its parameters: test_matches_single_process...)
    assert {r["loss_scale"] for r in resumed} == {128.0}, "the scaler's state is restored onto another layout"


def test_a_loss_summed_over_samples_adds_up_over_micro_batches_or_is_warned_about(
    jobs: dict, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Recognised or declared sums train as one process does (the parity cases above); an undeclared one is warned
    about once per rank that computes it, and trains as a mean would (not the single-process math)."""
    results = _results(jobs, 4, tmp_path_factory)
    warned = {name: [w for r in results[name] for w in r["warnings"] if "loss_reduction" in w] for name in results}
    assert not [w for name, ws in warned.items() if name != "P2D2-summed-loss-undeclared" for w in ws], warned
    undeclared = warned["P2D2-summed-loss-undeclared"]
    assert len(undeclared) == 2 and "reduction='sum'" in undeclared[0], undeclared  # the last stage of each replica
    case = next(s for s in WORLD_4 if s["name"] == "P2D2-summed-loss-undeclared")
    with pytest.raises(AssertionError, match="differ from the single-process run"):
        assert_same_params(merged_state(results[case["name"]]), reference_run(case))


def test_lists_the_steps_append_to_hold_what_one_process_s_do_on_every_rank(jobs: dict, tmp_path_factory) -> None:
    case = next(s for s in WORLD_4 if s["name"] == "P4D1-step-outputs-collected-in-lists")
    ranks = _results(jobs, 4, tmp_path_factory)[case["name"]]
    ref = reference_run(case)
    # (callbacks see each epoch's values before the module's epoch-end hook: its training values a epoch later)
    names = ("epoch_mean_loss", "epoch_steps", "epoch_batch_indices", "val_mse_all", "val_rows")
    epochs = [{k: v for k, v in e.items() if k in names} for e in ref["epoch_metrics"]] + [ref["metrics"]]
    assert epochs[-1]["epoch_steps"] == 4.0 and epochs[-1]["val_rows"] == 36 + 100 * 3, epochs
    assert sum(len(e) for e in epochs) > len(names) + 2, epochs
    for rank, r in enumerate(ranks):
        for got, want in zip([*r["epoch_metrics"], r["metrics"]], epochs, strict=True):
            for name in want.keys() & set(names):
                assert got[name] == pytest.approx(want[name], abs=1e-5), (rank, name, got, want)


def test_the_model_summary_shows_the_whole_model_on_every_rank(jobs: dict, tmp_path_factory) -> None:
    case = next(s for s in WORLD_4 if s["name"] == "P4D1-model-summary-example-input-tied")
    ranks = _results(jobs, 4, tmp_path_factory)[case["name"]]
    table, totals = reference_run(case)["summary"]
    assert "In sizes" in table and table["Type"] == ["Sequential", "Sequential", "Sequential"], table
    for r in ranks:
        assert r["summary"] == [table, totals]


def test_a_prediction_writer_writes_each_sample_once_with_its_index(jobs: dict, tmp_path_factory) -> None:
    """A ``BasePredictionWriter`` writes on one rank per replica (the pipeline's others have the same predictions),
    with the dataset indices of the replica's rows, per batch and at the epoch's end: together, every sample once."""
    case = next(s for s in WORLD_4 if s["name"] == "P2D2-validation-test-predict")
    ranks = _results(jobs, 4, tmp_path_factory)[case["name"]]
    want = torch.cat(reference_run(case)["predict"])  # (the eval loader does not shuffle: row i is sample i)
    writers = [r["written"] for r in ranks if r["written"]["batches"]]
    assert len(writers) == 2 and all(not r["written"]["epochs"] for r in ranks if r["written"] not in writers)
    for kind in ("batches", "epochs"):
        rows: dict[int, torch.Tensor] = {}
        for written in writers:
            pairs = written["batches"] if kind == "batches" else list(zip(*written["epochs"][0]))
            for indices, prediction in pairs:
                assert len(indices) == len(prediction) > 0
                for i, row in zip(indices, prediction):
                    assert i not in rows, f"sample {i} written twice"
                    rows[i] = row
        assert sorted(rows) == list(range(len(want)))
        torch.testing.assert_close(torch.stack([rows[i] for i in range(len(want))]), want, atol=1e-5, rtol=0)
