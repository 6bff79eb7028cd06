"""Decide the layout when the job starts: profile on rank 0, plan, share the decision with every rank.

    choice = choose_layout(module, split, trainer, requested, world_size=8, device=dev, broadcast=strategy.broadcast)
    choice.pipeline_stages, choice.microbatches, choice.schedule, choice.cuts

Whatever the user fixed (``pipeline_stages=4``, ``schedule="GPipe"``, explicit cuts ...) is kept;
``"auto"`` values are planned from a profile of the model on one micro-batch of the real training
data. Without training data (validate/test/predict only) simple rules apply instead.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils._pytree import tree_map

from lightning_spot.layout import Layout, LayoutError
from lightning_spot.partition.balance import balanced_cuts
from lightning_spot.partition.cuts import plan_stages
from lightning_spot.partition.discovery import ModelSplit
from lightning_spot.partition.profile import ModelProfile, forward_inputs, profile_model
from lightning_spot.planner import PLANNED_SCHEDULES, Candidate, Hardware, evaluate, measure_hardware, plan_layouts

log = logging.getLogger(__name__)
Partition = Union[Literal["auto", "uniform", "balanced"], Sequence[int]]


@dataclass
class Requested:
    """The layout settings as the user gave them (``"auto"`` / ``None`` where they are to be chosen)."""

    pipeline_stages: int | str
    microbatches: int | str
    schedule: str
    partition: Partition
    activation_checkpointing: bool | None
    device_memory: float | None
    stages_per_rank: int | None

    def per_rank(self, schedule: str) -> int:
        """Stages per rank of ``schedule`` (1F1B when it is still "auto")."""
        from lightning_spot.schedules import resolve_schedule

        return resolve_schedule("1F1B" if schedule == "auto" else schedule, self.stages_per_rank).stages_per_rank

    @property
    def wants_plan(self) -> bool:
        return (
            self.pipeline_stages == "auto"
            or self.microbatches == "auto"
            or self.schedule == "auto"
            or self.activation_checkpointing is None
            or self.partition == "balanced"
        )


@dataclass
class LayoutChoice:
    pipeline_stages: int
    microbatches: int | str
    schedule: str
    activation_checkpointing: bool
    cuts: list[int] | None
    plan: dict[str, Any] | None = None
    runners_up: list[dict[str, Any]] = field(default_factory=list)


def parse_bytes(value: float | str | None) -> float | None:
    """``"80GB"``, ``"512MiB"``, ``2e9`` -> bytes."""
    if value is None or isinstance(value, (int, float)):
        return value
    text = str(value).strip().upper().replace(" ", "")
    units = {"TIB": 2**40, "GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "TB": 1e12, "GB": 1e9, "MB": 1e6, "KB": 1e3, "B": 1}
    for unit, factor in units.items():
        if text.endswith(unit):
            return float(text[: -len(unit)]) * factor
    return float(text)


def default_hardware(device: torch.device, memory: float | None, local_processes: int) -> Hardware:
    """Memory per device and, on CPUs, how much the processes of a node slow each other down."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return Hardware(memory_bytes=memory or 0.9 * total, optimizer_bytes_per_s=500e9)
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024 / max(local_processes, 1)
    except OSError:
        pass
    cores = os.cpu_count() or 1
    slowdown = max(1.0, local_processes * torch.get_num_threads() / cores)
    return Hardware(memory_bytes=memory or available, compute_slowdown=slowdown, optimizer_bytes_per_s=2e9,
                    p2p_bytes_per_s=2e9, allreduce_bytes_per_s=1e9)


def sample_batch(trainer: Any) -> tuple[int, Any] | None:
    """(global batch size, one batch) of the training data, if this run trains and has a DataLoader."""
    from torch.utils.data import DataLoader

    source = getattr(trainer.fit_loop, "_data_source", None)
    if trainer.state.fn != TrainerFn.FITTING or source is None or not source.is_defined():
        return None
    loader = source.dataloader()
    if not isinstance(loader, DataLoader) or not loader.batch_size:
        return None
    return int(loader.batch_size), next(iter(loader))


def _first_samples(batch: Any, size: int, count: int) -> Any:
    return tree_map(lambda t: t[:count] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == size else t, batch)


def _fallback(requested: Requested, split: ModelSplit, world_size: int) -> LayoutChoice:
    per_rank = requested.per_rank(requested.schedule)
    layout = Layout.for_world(world_size, requested.pipeline_stages, num_layers=split.num_layers // per_rank)  # type: ignore[arg-type]
    cuts = list(requested.partition) if not isinstance(requested.partition, str) else None
    schedule = "1F1B" if requested.schedule == "auto" else requested.schedule
    return LayoutChoice(layout.pipeline_stages, requested.microbatches, schedule, bool(requested.activation_checkpointing), cuts)


def choose_layout(
    module: torch.nn.Module,
    split: ModelSplit,
    trainer: Any,
    requested: Requested,
    *,
    world_size: int,
    device: torch.device,
    is_rank_zero: bool,
    broadcast: Callable[[Any], Any],
    autocast: Callable[[], Any],
    cache_dir: Path | None,
) -> LayoutChoice:
    """The layout to build on every rank (a collective call: all ranks get rank 0's decision)."""
    if requested.pipeline_stages != "auto":  # clear errors if the fixed depth cannot fit, before any profiling
        Layout.for_world(world_size, requested.pipeline_stages)  # type: ignore[arg-type]
        plan_stages(split.num_layers, requested.pipeline_stages, stages_per_rank=requested.per_rank(requested.schedule))  # type: ignore[arg-type]
    if not requested.wants_plan:
        return _fallback(requested, split, world_size)
    sample = broadcast(sample_batch(trainer) if is_rank_zero else None)
    if sample is None:
        return _fallback(requested, split, world_size)
    global_batch, batch = sample
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    hardware = measure_hardware(device, default_hardware(device, requested.device_memory, local))  # collective
    choice: LayoutChoice | Exception | None = None
    if is_rank_zero:
        samples = max(1, min(global_batch, global_batch // world_size))
        try:
            args, kwargs = forward_inputs(module, _first_samples(batch, global_batch, samples))
            args, kwargs = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, (args, kwargs))
            profile = profile_model(module, split, args, kwargs, device=device, samples=samples, autocast=autocast,
                                    cache_dir=cache_dir, progress=True)
        except Exception as err:  # noqa: BLE001 - planning is an optimisation; the run itself reports contract errors
            log.warning("lightning-spot: could not profile the model (%s); using the simple layout rules", err)
            choice = _fallback(requested, split, world_size)
        else:
            try:
                choice = _decide(profile, requested, split, world_size, global_batch, hardware)
            except LayoutError as err:  # e.g. nothing fits in memory: every rank raises the same error
                choice = err
    choice = broadcast(choice)
    if isinstance(choice, Exception):
        raise choice
    return choice


def _decide(
    profile: ModelProfile, requested: Requested, split: ModelSplit, world_size: int, global_batch: int, hardware: Hardware
) -> LayoutChoice:
    explicit_cuts = None if isinstance(requested.partition, str) else list(requested.partition)
    if requested.schedule not in ("auto", *PLANNED_SCHEDULES) or explicit_cuts is not None:
        # layouts the planner does not model: keep the simple rules, balance the cuts by time if asked
        choice = _fallback(requested, split, world_size)
        if requested.partition == "balanced":
            stages = choice.pipeline_stages * requested.per_rank(choice.schedule)
            times = [p.forward_s + p.backward_s for p in profile.layers]
            choice.cuts = balanced_cuts(times, stages, first_extra=profile.first.forward_s + profile.first.backward_s,
                                        last_extra=profile.last.forward_s + profile.last.backward_s)
        return choice
    fixed_p = requested.pipeline_stages if isinstance(requested.pipeline_stages, int) else None
    candidates = plan_layouts(
        profile,
        world_size=world_size,
        global_batch=global_batch,
        hardware=hardware,
        schedules=PLANNED_SCHEDULES if requested.schedule == "auto" else (requested.schedule,),
        checkpointing=(False, True) if requested.activation_checkpointing is None else (requested.activation_checkpointing,),
        pipeline_stages=fixed_p,
    )
    if isinstance(requested.microbatches, int):
        fitting = [c for c in candidates if c.microbatches == requested.microbatches]
        if not fitting:
            d = world_size // candidates[0].pipeline_stages
            fitting = [evaluate(profile, pipeline_stages=candidates[0].pipeline_stages, data_parallel=d,
                                microbatches=requested.microbatches, global_batch=global_batch,
                                schedule=candidates[0].schedule, hardware=hardware)]
        candidates = fitting
    best = candidates[0]
    cuts = best.cuts if requested.partition in ("auto", "balanced") else None
    return LayoutChoice(
        best.pipeline_stages, best.microbatches, best.schedule, best.activation_checkpointing, cuts,
        plan=best.to_dict(), runners_up=[c.to_dict() for c in candidates[1:4]],
    )


def describe_choice(choice: LayoutChoice) -> None:
    if choice.plan is None:
        return
    best = Candidate(**choice.plan)
    lines = [f"spot_pipeline plan: {best.describe()}"]
    lines += [f"  runner-up: {Candidate(**c).describe()}" for c in choice.runners_up]
    rank_zero_info("\n".join(lines))
