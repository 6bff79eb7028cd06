"""The strategy's arguments, checked once into a frozen value.

    settings = PipelineSettings.from_args(pipeline_stages=2, microbatches=4, schedule="1F1B", offload=None)
    settings.requested            # what the planner is asked (``"auto"`` where it is to choose)
    check_supported(module, precision_plugin, settings)   # at setup: what spot_pipeline cannot run, named

Wrong values fail when the strategy is made, not after start-up: microbatches per pipeline without as many
depths, an unknown schedule, partition or offload level.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import Precision

from lightning_spot.checkpoint.sources import StateSources
from lightning_spot.layout import LayoutError, StagesArg
from lightning_spot.partition.discovery import ModelContractError
from lightning_spot.planning.choose import Requested
from lightning_spot.planning.memory import PlanPlace
from lightning_spot.runtime.offload import offload_levels
from lightning_spot.runtime.schedules import resolve_schedule
from lightning_spot.torchft import TorchFT, resolve_fault_tolerance
from lightning_spot.utils.units import parse_bytes

SUPPORTED_PRECISION = ("32-true", "16-mixed", "bf16-mixed", "bf16-true", "16-true", "64-true")
Microbatches = Union[int, list[int], Literal["auto"]]
PartitionArg = Union[Literal["auto", "uniform", "balanced"], Sequence[int]]


@dataclass(frozen=True)
class PipelineSettings:
    """What ``SpotPipelineStrategy`` was asked for (see its docstring), checked."""

    requested: Requested
    profile_cache: Optional[str]
    layers: str
    first_stage_modules: tuple[str, ...]
    last_stage_modules: tuple[str, ...]
    ddp_kwargs: dict[str, Any] = field(default_factory=dict)
    pretrained: Optional[str] = None
    timeout: Optional[timedelta] = None
    step_timeout: Optional[float] = None
    fault_tolerance: Optional[TorchFT] = None

    @classmethod
    def from_args(
        cls,
        *,
        pipeline_stages: StagesArg = "auto",
        microbatches: Microbatches = "auto",
        schedule: str = "auto",
        stages_per_rank: Optional[int] = None,
        partition: PartitionArg = "auto",
        activation_checkpointing: Optional[bool] = None,
        device_memory: Union[int, float, str, None] = None,
        profile_cache: Optional[str] = None,
        layers: str = "auto",
        first_stage_modules: Sequence[str] = (),
        last_stage_modules: Sequence[str] = (),
        find_unused_parameters: bool = False,
        pretrained: Optional[str] = None,
        offload: Union[str, list[str], None] = None,
        timeout: Optional[timedelta] = None,
        step_timeout: Optional[float] = None,
        fault_tolerance: Union[str, TorchFT, None] = None,
    ) -> PipelineSettings:
        if isinstance(microbatches, (list, tuple)):
            if isinstance(pipeline_stages, (int, str)) or len(microbatches) != len(pipeline_stages):
                raise LayoutError(
                    f"microbatches={list(microbatches)} gives one count per pipeline; it needs pipeline_stages as a list "
                    f"of as many depths (e.g. pipeline_stages=[2, 3], microbatches=[3, 5]), got {pipeline_stages!r}"
                )
            if any(not isinstance(m, int) or m < 1 for m in microbatches):
                raise LayoutError(f"microbatches must be positive ints, got {list(microbatches)}")
            microbatches = [int(m) for m in microbatches]
        elif microbatches != "auto" and (not isinstance(microbatches, int) or microbatches < 1):
            raise LayoutError(f"microbatches must be a positive int, a list of them or 'auto', got {microbatches!r}")
        if not isinstance(pipeline_stages, (int, str)):
            pipeline_stages = [int(p) for p in pipeline_stages]
        levels = offload_levels(offload)
        if schedule == "auto" and "parameters" in levels:
            schedule = "LoopedBFS"  # Harmony's order: a stage's weights come once for all micro-batches
        if schedule != "auto":
            resolve_schedule(schedule, stages_per_rank)  # unknown names fail here, not after start-up
        if isinstance(partition, str) and partition not in ("auto", "uniform", "balanced"):
            raise LayoutError(
                f"partition must be 'auto', 'uniform', 'balanced' or a list of cut indices, got {partition!r}"
            )
        requested = Requested(
            pipeline_stages=pipeline_stages,
            microbatches=microbatches,
            schedule=schedule,
            partition=partition if isinstance(partition, str) else [int(c) for c in partition],
            activation_checkpointing=activation_checkpointing,
            device_memory=parse_bytes(device_memory),
            stages_per_rank=stages_per_rank,
            offload=levels,
        )
        return cls(
            requested=requested,
            profile_cache=profile_cache,
            layers=layers,
            first_stage_modules=tuple(first_stage_modules),
            last_stage_modules=tuple(last_stage_modules),
            ddp_kwargs={"find_unused_parameters": find_unused_parameters},
            pretrained=pretrained,
            timeout=timeout,
            step_timeout=step_timeout,
            fault_tolerance=resolve_fault_tolerance(fault_tolerance),
        )

    @property
    def cache_dir(self) -> Optional[Path]:
        """Where layer profiles are kept (``None``: not kept)."""
        return Path(os.path.expanduser(self.profile_cache)) if self.profile_cache else None

    def plan_places(self, sources: StateSources) -> list[PlanPlace]:
        """Where the plan of this job is remembered: its run directory (follows the job) and the local cache."""
        places = []
        if sources.run_url:
            places.append(PlanPlace(sources.run_url.rstrip("/") + "/plans", sources.storage_options))
        if self.profile_cache:
            places.append(PlanPlace(os.path.join(os.path.expanduser(self.profile_cache), "plans")))
        return places


def check_supported(module: pl.LightningModule, precision: Precision, settings: PipelineSettings) -> None:
    """What spot_pipeline does not run, named with the way out: manual optimization, other precisions, fp16 with
    state offloaded to host memory."""
    if not module.automatic_optimization:
        raise ModelContractError(
            "spot_pipeline runs forward and backward of all micro-batches inside one pipeline schedule, so it "
            "needs automatic optimization; remove `self.automatic_optimization = False` / manual_backward."
        )
    name = str(getattr(precision, "precision", "32-true"))
    if name not in SUPPORTED_PRECISION:
        raise LayoutError(
            f"precision={name!r} is not supported by spot_pipeline. Use one of {list(SUPPORTED_PRECISION)}."
        )
    levels = settings.requested.offload
    if name == "16-mixed" and levels != "auto" and {"optimizer", "parameters"} & set(levels):
        raise LayoutError(
            f"precision='16-mixed' with offload={list(levels)} is not supported yet (the gradient scaler would "
            f"unscale gradients in host memory). Use precision='bf16-mixed' with offload, or fp16 without it."
        )
