"""The pipeline built at setup, as a recipe of named steps (torchtitan's style): layout, groups, engine, weights.

    built = build_pipeline(module, settings, sources, precision=plugin, device=dev, rank=0, world_size=4,
                           compiler=None, trace_allreduce=False, grads_final=hook)
    built.engine, built.choice, built.mesh, built.pretrained_reads

    route_gradient_clipping(built.engine, plugin, dev)   # clip by the norm over every stage

The steps: the layer sequence and the stage of each module beside it (one run of the step on a sample of the
training data) → the layout (planned, or as asked) → the process groups of that layout → the engine, with what it
needs handed in (the agreed loss scaler, activation offload, the hooks run when a stage's gradients are final) →
pretrained weights read for this rank's stages → the precision's conversion → data-parallel wrapping.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_spot.checkpoint.sources import StateSources
from lightning_spot.observe import grad_norms
from lightning_spot.partition.discovery import ModelSplit, discover
from lightning_spot.partition.placement import placement_of
from lightning_spot.partition.pretrained import SafetensorsWeights, load_stage_weights
from lightning_spot.partition.run_order import place_by_run
from lightning_spot.planning.choose import (
    LayoutChoice,
    choose_layout,
    describe_choice,
    first_samples,
    shared_sample_batch,
)
from lightning_spot.runtime.compiled import Compiler
from lightning_spot.runtime.cross_pipeline import mixed_groups
from lightning_spot.runtime.engine import ParallelContext, PipelineEngine
from lightning_spot.runtime.grads import global_norm_clipping, norm_scope
from lightning_spot.runtime.loss_scale import coordinated_scaler
from lightning_spot.runtime.offload import ActivationOffload, OptimizerOffload
from lightning_spot.strategy.settings import PipelineSettings
from lightning_spot.utils.distributed import broadcast_object, is_initialized
from lightning_spot.watchdog import DEFAULT_STEP_TIMEOUT

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass
class BuiltPipeline:
    """What :func:`build_pipeline` made: the engine, the layout choice, the device mesh (a P x D grid), and the
    names of the pretrained tensors this rank read."""

    engine: PipelineEngine
    choice: LayoutChoice
    mesh: Optional[DeviceMesh] = None
    pretrained_reads: list[str] = field(default_factory=list)


def build_pipeline(
    module: pl.LightningModule,
    settings: PipelineSettings,
    sources: StateSources,
    *,
    precision: Precision,
    device: torch.device,
    rank: int,
    world_size: int,
    compiler: Optional[Compiler],
    trace_allreduce: bool,
    grads_final: Callable[[int], None],
) -> BuiltPipeline:
    """This rank's part of the pipeline, ready to train (see the module's text)."""
    previous = placement_of(module)  # (placed by an earlier Trainer: its split and layout stand)
    sample = shared_sample_batch(module.trainer) if previous is None else None
    split = previous.split if previous is not None else split_model(module, settings, sample, rank)
    choice = module.__dict__.get("_spot_layout_choice") if previous is not None else None
    if choice is None:
        places = settings.plan_places(sources)
        choice = choose_layout(
            module,
            split,
            settings.requested,
            sample,
            world_size=world_size,
            device=device,
            autocast=precision.forward_context,
            cache_dir=settings.cache_dir,
            plan_places=places,
            run_place=places[0] if sources.run_url else None,
            measured=settings.fault_tolerance is None,  # torchft's pipelines decide alone: alike, not measured
        )
    module.__dict__["_spot_layout_choice"] = choice
    describe_choice(choice)
    ctx, mesh = parallel_context(choice, rank, device)
    engine = PipelineEngine(
        module,
        split,
        choice.layout,
        ctx,
        seed=int(os.environ.get("PL_GLOBAL_SEED", 0)),
        ddp_kwargs=settings.ddp_kwargs,
        activation_checkpointing=choice.activation_checkpointing,
        compiler=compiler,
        outside_timeout=settings.step_timeout or DEFAULT_STEP_TIMEOUT,
        scaler=coordinated_scaler(precision),  # fp16: one loss scale everywhere
        activation_offload=ActivationOffload(device) if "activations" in choice.offload else None,
        grads_final=(grads_final,),
        optimizer_offload="optimizer" in choice.offload,
        replica_group=str(settings.fault_tolerance.resolved().replica_group) if settings.fault_tolerance else None,
    )
    rank_zero_info(f"spot_pipeline: {engine.describe()}")
    reads = load_pretrained(module, settings.pretrained, engine.ties.aliases) if settings.pretrained else []
    precision.convert_module(module)
    engine.wrap_data_parallel(trace_allreduce=trace_allreduce, stream_weights="parameters" in choice.offload)
    return BuiltPipeline(engine, choice, mesh, reads)


def split_model(
    module: pl.LightningModule, settings: PipelineSettings, sample: Optional[tuple[int, Any]], rank: int
) -> ModelSplit:
    """The layer sequence and the stage of each module beside it: where one run of the step on a sample of the
    training data uses it, else by registration order (collective when there is a sample)."""
    split = discover(
        module,
        settings.layers,
        first_stage_modules=settings.first_stage_modules,
        last_stage_modules=settings.last_stage_modules,
    )
    if sample is None:
        return split
    size, batch = sample
    fixed = (*settings.first_stage_modules, *settings.last_stage_modules)
    placed = place_by_run(module, split, first_samples(batch, size, 1), fixed) if rank == 0 else None
    return broadcast_object(placed)


def parallel_context(choice: LayoutChoice, rank: int, device: torch.device) -> tuple[ParallelContext, Any]:
    """This rank's place in the layout and its process groups (pipeline, replicas), and the device mesh of a
    P x D grid (``None`` for pipelines of mixed depths, or without a process group)."""
    grid, mesh = choice.layout.grid, None
    if is_initialized() and grid.is_mixed:
        pp_group, dp_group = mixed_groups(grid, rank)
    elif is_initialized():
        mesh = grid.device_mesh(device.type)
        pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
    else:
        pp_group = dp_group = None
    ctx = ParallelContext(
        pp_rank=grid.pp_rank(rank), dp_rank=grid.dp_rank(rank), pp_group=pp_group, dp_group=dp_group, device=device
    )
    return ctx, mesh


def load_pretrained(module: pl.LightningModule, path: str, aliases: dict[str, str]) -> list[str]:
    """Read this rank's stages' tensors from a ``save_pretrained`` directory; the names read."""
    weights = SafetensorsWeights(path)
    count = load_stage_weights(module, weights, aliases)
    rank_zero_info(
        f"spot_pipeline: {count} pretrained tensors of this rank's stages read from {path} "
        f"({weights.read_bytes / 2**20:.1f} MiB; rank 0)"
    )
    return list(weights.read_names)


def route_gradient_clipping(engine: PipelineEngine, precision: Precision, device: torch.device) -> None:
    """Clip by the global norm over all stages instead of each rank's local norm (and let ``grad_norm`` report
    every stage's norms)."""
    scope = norm_scope(engine.layout.is_mixed, engine.ctx.pp_group, engine.ctx.dp_rank, engine.ties.duplicates)
    precision.clip_grad_by_norm = global_norm_clipping(scope, device)  # type: ignore[method-assign,assignment]
    grad_norms.use_scope(scope)


def offload_optimizers(engine: PipelineEngine, optimizers: list[Any]) -> OptimizerOffload:
    """``offload="optimizer"``: fp32 masters and optimizer state in host memory (the streamed weights' masters when
    the weights are streamed too); the parameters trainable then are the ones followed (``engine.fixed_params``)."""
    masters = engine.runner.weights.masters if engine.runner.weights is not None else None
    offload = OptimizerOffload(optimizers, masters=masters)
    if offload.fused:
        rank_zero_info(
            f"spot_pipeline: the update in host memory runs torch's fused CPU kernel "
            f"({', '.join(offload.fused)}); pass fused=False or foreach=... to the optimizer to keep yours"
        )
    return offload
