"""Decide the layout when the job starts: profile on rank 0, plan, share the decision with every rank.

    sample = shared_sample_batch(trainer)       # collective: (global batch, a batch) of the training data, or None
    choice = choose_layout(module, split, requested, sample, world_size=8, device=dev, autocast=..., cache_dir=None)
    choice.layout            # PipelineLayout: P x D, schedule, stages, cuts, micro-batches (an int)
    choice.activation_checkpointing

Whatever the user fixed (``pipeline_stages=4``, ``schedule="GPipe"``, explicit cuts ...) is kept;
``"auto"`` values are planned from a profile of the model on one micro-batch of the real training
data. Without training data (validate/test/predict only) simple rules apply instead.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union, cast

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils._pytree import tree_map

from lightning_spot.data.streams import peek_batch
from lightning_spot.layout import Layout, LayoutError, PipelineLayout, StagesArg
from lightning_spot.partition.balance import balanced_cuts
from lightning_spot.partition.cuts import plan_stages
from lightning_spot.partition.discovery import ModelSplit
from lightning_spot.planning.cost_model import (
    OFFLOAD_CHOICES,
    PLANNED_SCHEDULES,
    Candidate,
    evaluate,
    plan_layouts,
)
from lightning_spot.planning.hardware import Hardware, default_hardware
from lightning_spot.planning.memory import (
    PLAN_MARGIN,
    PlanMemory,
    PlanPlace,
    decision_name,
    keep_or_switch,
    plan_key,
    reuse_or_measure,
    world_hosts,
)
from lightning_spot.planning.mixed import (
    MixedCandidate,
    fewest_microbatches,
    layer_count_seconds,
    mixed_cuts,
    plan_mixed,
    predict_mixed,
    split_microbatches,
    total_microbatches,
)
from lightning_spot.planning.profile import ModelProfile, forward_call, profile_model, rooted
from lightning_spot.replay.pytree import register_containers
from lightning_spot.runtime.schedules import resolve_schedule
from lightning_spot.utils.distributed import broadcast_object, rank
from lightning_spot.utils.units import divisors

log = logging.getLogger(__name__)
Partition = Union[Literal["auto", "uniform", "balanced"], Sequence[int]]
MicrobatchesArg = Union[int, list[int], Literal["auto"]]


@dataclass(frozen=True)
class Requested:
    """The layout settings as the user gave them (``"auto"`` / ``None`` where they are to be chosen)."""

    pipeline_stages: StagesArg
    microbatches: MicrobatchesArg
    schedule: str
    partition: Partition
    activation_checkpointing: bool | None
    device_memory: float | None
    stages_per_rank: int | None
    #: training state to keep in host memory (``("optimizer",)`` ...), or "auto": the planner decides
    offload: tuple[str, ...] | str = ()

    @property
    def offloads(self) -> tuple[tuple[str, ...], ...]:
        """The offload levels the planner may choose from."""
        return OFFLOAD_CHOICES if self.offload == "auto" else (tuple(self.offload),)

    def per_rank(self, schedule: str) -> int:
        """Stages per rank of ``schedule`` (1F1B when it is still "auto")."""
        return resolve_schedule("1F1B" if schedule == "auto" else schedule, self.stages_per_rank).stages_per_rank

    @property
    def wants_plan(self) -> bool:
        return (
            self.pipeline_stages == "auto"
            or self.microbatches == "auto"
            or self.schedule == "auto"
            or self.activation_checkpointing is None
            or self.partition == "balanced"
            or self.offload == "auto"
        )


@dataclass(frozen=True)
class LayoutChoice:
    """The decision: the layout to build, whether to recompute activations, and the plan behind it."""

    layout: PipelineLayout
    activation_checkpointing: bool
    #: the chosen :class:`Candidate` as a dict, when the planner chose; the next best ones
    plan: dict[str, Any] | None = None
    runners_up: tuple[dict[str, Any], ...] = ()
    #: why this plan (kept from the last start, changed, or new), for the log
    reason: str = ""
    #: the chosen :class:`MixedCandidate` as a dict, when the planner chose pipelines of mixed depths
    mixed_plan: dict[str, Any] | None = None
    #: training state kept in host memory
    offload: tuple[str, ...] = ()


@dataclass
class _Draft:
    """A decision before the stages are cut and the micro-batch count settled (what rank 0 shares)."""

    pipeline_stages: StagesArg
    microbatches: MicrobatchesArg
    schedule: str
    activation_checkpointing: bool
    #: the cuts; with pipelines of mixed depths one list per pipeline
    cuts: list[int] | list[list[int]] | None
    plan: dict[str, Any] | None = None
    runners_up: list[dict[str, Any]] = field(default_factory=list)
    reason: str = ""
    mixed_plan: dict[str, Any] | None = None
    offload: tuple[str, ...] = ()


def sample_batch(trainer: Any) -> tuple[int, Any] | None:
    """(global batch size, one batch) of the training data, if this run trains and has a DataLoader."""
    from torch.utils.data import DataLoader

    source = getattr(trainer.fit_loop, "_data_source", None)
    if trainer.state.fn != TrainerFn.FITTING or source is None or not source.is_defined():
        return None
    loader = source.dataloader()
    if not isinstance(loader, DataLoader) or not loader.batch_size:
        return None
    return int(loader.batch_size), peek_batch(loader)  # (a stateful stream is put back where it was)


def shared_sample_batch(trainer: Any) -> tuple[int, Any] | None:
    """Collective: rank 0's :func:`sample_batch` on every rank."""
    sample = broadcast_object(sample_batch(trainer) if rank() == 0 else None)
    if sample is not None:
        register_containers(sample[1])
    return sample


def first_samples(batch: Any, size: int, count: int) -> Any:
    """The first ``count`` samples of a batch of ``size``."""
    return tree_map(lambda t: t[:count] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == size else t, batch)


def _fallback(requested: Requested) -> _Draft:
    cuts: Any = list(requested.partition) if not isinstance(requested.partition, str) else None
    schedule = "1F1B" if requested.schedule == "auto" else requested.schedule
    offload = () if requested.offload == "auto" else tuple(requested.offload)
    return _Draft(
        requested.pipeline_stages,
        requested.microbatches,
        schedule,
        bool(requested.activation_checkpointing),
        cuts,
        offload=offload,
    )


def default_microbatches(grid: Layout, num_stages: int, global_batch: int | None) -> int:
    """Micro-batches when nobody chose: the fewest that are at least 2 x P (and the stage count) and
    divide each replica's share of the global batch (the share itself when none does)."""
    target = max(2 * grid.pipeline_stages, num_stages)
    if global_batch is None or global_batch % grid.data_parallel:
        return target
    local = global_batch // grid.data_parallel
    fitting = [d for d in divisors(local) if d >= target]
    return fitting[0] if fitting else local


def _settle(
    draft: _Draft, requested: Requested, split: ModelSplit, world_size: int, global_batch: int | None
) -> LayoutChoice:
    """Cut the stages and fix the micro-batch count: the :class:`PipelineLayout` every rank builds."""
    per_rank = requested.stages_per_rank
    looped = resolve_schedule(draft.schedule)
    if per_rank is None and "parameters" in draft.offload and looped.is_multi_stage and looped.style == "loop":
        # one layer per stage: each layer's weights come to the device on their own (Harmony)
        depth = Layout.for_world(world_size, draft.pipeline_stages, num_layers=split.num_layers).pipeline_stages
        per_rank = max(1, split.num_layers // depth)
    spec = resolve_schedule(draft.schedule, per_rank)
    grid = Layout.for_world(world_size, draft.pipeline_stages, num_layers=split.num_layers // spec.stages_per_rank)
    if grid.is_mixed:
        return _settle_mixed(draft, grid, spec.name, split, global_batch)
    cuts = cast(Optional[list[int]], draft.cuts)
    plan = plan_stages(
        split.num_layers, grid.pipeline_stages, stages_per_rank=spec.stages_per_rank, style=spec.style, cuts=cuts
    )
    microbatches = draft.microbatches
    if isinstance(microbatches, list):
        raise LayoutError(
            f"microbatches={microbatches} gives one count per pipeline: pipelines of one depth take an int"
        )
    if microbatches == "auto":
        microbatches = default_microbatches(grid, plan.num_stages, global_batch)
    layout = PipelineLayout(grid, spec.name, plan.num_stages, tuple(plan.cuts), microbatches)
    return LayoutChoice(
        layout,
        draft.activation_checkpointing,
        draft.plan,
        tuple(draft.runners_up),
        draft.reason,
        offload=draft.offload,
    )


def _settle_mixed(
    draft: _Draft, grid: Layout, schedule: str, split: ModelSplit, global_batch: int | None
) -> LayoutChoice:
    """Pipelines of mixed depths: each one's cuts (planned, else even) and its share of the micro-batches."""
    if schedule not in PLANNED_SCHEDULES:
        raise LayoutError(
            f"pipelines of mixed depths ({grid}) run 1F1B or GPipe (one stage per rank), not {schedule}. "
            f"Use schedule='1F1B', 'GPipe' or 'auto'."
        )
    depths = grid.pipeline_depths
    cuts = draft.cuts
    if cuts is not None and not all(isinstance(c, list) for c in cuts):
        raise LayoutError(
            "explicit cut indices fit one pipeline depth; with pipelines of mixed depths use "
            "partition='balanced' (cut by measured cost) or 'uniform' (even layer counts)."
        )
    given = cast(list[list[int]], cuts) if cuts is not None else [None] * len(depths)
    per_pipeline = [plan_stages(split.num_layers, d, cuts=c).cuts for d, c in zip(depths, given)]
    microbatches = draft.microbatches
    if not isinstance(microbatches, list):
        total = total_microbatches(depths, schedule, global_batch) if microbatches == "auto" else microbatches
        seconds = [layer_count_seconds(split.num_layers, d, c) for d, c in zip(depths, per_pipeline)]
        microbatches = split_microbatches(int(total), depths, seconds, schedule)
    for d, m in zip(depths, microbatches):
        if m < fewest_microbatches(d, schedule):
            raise LayoutError(f"{schedule} needs at least {d} micro-batches on a pipeline of depth {d}, got {m}")
    layout = PipelineLayout.mixed(grid, schedule, per_pipeline, microbatches)
    return LayoutChoice(
        layout, draft.activation_checkpointing, None, (), draft.reason, draft.mixed_plan, offload=draft.offload
    )


def choose_layout(
    module: torch.nn.Module,
    split: ModelSplit,
    requested: Requested,
    sample: tuple[int, Any] | None,
    *,
    world_size: int,
    device: torch.device,
    autocast: Callable[[], Any],
    cache_dir: Path | None,
    plan_places: Sequence[PlanPlace] = (),
    run_place: PlanPlace | None = None,
    measured: bool = True,
) -> LayoutChoice:
    """The layout to build on every rank (a collective call: all ranks get rank 0's decision).

    ``measured=False``: what is left to choose follows the simple rules (even cuts, the default micro-batch count,
    no activation checkpointing), never a measurement: several process groups that must build the same layout
    without talking to each other (the pipelines of a torchft job) each decide alone.

    Profiles and hardware measurements are cached in ``cache_dir``; the plan is remembered in
    ``plan_places`` and kept at the next start-up unless a new one is clearly better (``memory``).
    The whole decision is also remembered in the run's own ``run_place``: a restart of the run on the same
    processes (hosts, devices, threads) takes it without profiling, measuring or searching.
    """
    if requested.pipeline_stages != "auto":  # clear errors if the fixed depth cannot fit, before any profiling
        grid = Layout.for_world(world_size, requested.pipeline_stages)
        plan_stages(split.num_layers, max(grid.pipeline_depths), stages_per_rank=requested.per_rank(requested.schedule))
    if not requested.wants_plan:
        return _settle(_fallback(requested), requested, split, world_size, None)
    if not measured:
        if requested.partition == "balanced":
            log.warning(
                "lightning-spot: partition='balanced' is not used here: each pipeline would cut the model by its own "
                "measurements, and every pipeline must cut it alike; the cuts are even (give them as partition=[...])"
            )
        return _settle(_fallback(requested), requested, split, world_size, sample[0] if sample else None)
    is_rank_zero = rank() == 0
    if sample is None:
        return _settle(_fallback(requested), requested, split, world_size, None)
    global_batch, batch = sample
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    hosts = world_hosts(device)
    memory, run_memory = PlanMemory(plan_places), PlanMemory([run_place] if run_place else [])
    key = plan_key(module, split.layers_path, device, global_batch, requested) if is_rank_zero else ""
    kept = broadcast_object(_recall_decision(run_memory, decision_name(key, hosts)) if is_rank_zero else None)
    if kept is not None:  # a restart on the same processes: no profiling, hardware measurement or search
        return _settle(kept, requested, split, world_size, global_batch)
    hardware, reused = reuse_or_measure(
        device, default_hardware(device, requested.device_memory, local), cache_dir, hosts
    )
    draft: _Draft | Exception | None = None
    if is_rank_zero:
        samples = max(1, min(global_batch, global_batch // world_size))
        try:
            root, args, kwargs = forward_call(module, split, first_samples(batch, global_batch, samples))
            args, kwargs = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, (args, kwargs))
            profile = profile_model(
                *rooted(module, split, root),
                args,
                kwargs,
                device=device,
                samples=samples,
                autocast=autocast,
                cache_dir=cache_dir,
                progress=True,
            )
        except Exception as err:
            log.warning("lightning-spot: could not profile the model (%s); using the simple layout rules", err)
            draft = _fallback(requested)
        else:
            try:
                draft = _decide(profile, requested, world_size, global_batch, hardware, memory.recall(key))
            except LayoutError as err:  # e.g. nothing fits in memory: every rank raises the same error
                draft = err
            else:
                if draft.plan is not None:
                    memory.remember(key, Candidate(**draft.plan))
                    hardware_was = "reused" if reused else "measured now"
                    draft.reason += f" (hardware {hardware_was}; plans kept in {', '.join(p.url for p in plan_places) or 'no place'})"
                run_memory.write(decision_name(key, hosts), asdict(draft))
    draft = broadcast_object(draft)
    if isinstance(draft, Exception):
        raise draft
    assert draft is not None
    return _settle(draft, requested, split, world_size, global_batch)


def _recall_decision(memory: PlanMemory, name: str) -> _Draft | None:
    """The decision made at an earlier start on exactly these processes (same hosts, devices, threads, model,
    batch and arguments), marked as kept; ``None`` if there is none."""
    data = memory.read(name)
    if data is None:
        return None
    try:
        draft = _Draft(**data)
    except TypeError:  # written by another version
        return None
    draft.offload = tuple(draft.offload)
    draft.reason = (
        "the plan made at an earlier start on these same processes, kept without profiling, measuring or "
        f"searching again (they run when the processes change); then: {draft.reason}"
    )
    return draft


def _decide(
    profile: ModelProfile,
    requested: Requested,
    world_size: int,
    global_batch: int,
    hardware: Hardware,
    previous: Candidate | None = None,
) -> _Draft:
    explicit_cuts = None if isinstance(requested.partition, str) else list(requested.partition)
    if isinstance(requested.pipeline_stages, list) and explicit_cuts is None:
        return _decide_mixed(profile, requested, global_batch, hardware)
    # weights streamed (offload="parameters", LoopedBFS by default): planned by their own cost model
    streams = requested.offload != "auto" and "parameters" in requested.offload
    planned = ("auto", *PLANNED_SCHEDULES, *(("LoopedBFS",) if streams and requested.stages_per_rank is None else ()))
    if requested.schedule not in planned or explicit_cuts is not None:
        # layouts the planner does not model: keep the simple rules, balance the cuts by time if asked
        draft = _fallback(requested)
        if requested.partition == "balanced":
            per_rank = requested.per_rank(draft.schedule)
            grid = Layout.for_world(world_size, draft.pipeline_stages, num_layers=len(profile.layers) // per_rank)
            stages = grid.pipeline_stages * per_rank
            times = [p.forward_s + p.backward_s for p in profile.layers]
            draft.cuts = balanced_cuts(
                times,
                stages,
                first_extra=profile.first.forward_s + profile.first.backward_s,
                last_extra=profile.last.forward_s + profile.last.backward_s,
            )
        return draft
    fixed_p = requested.pipeline_stages if isinstance(requested.pipeline_stages, int) else None
    schedules = PLANNED_SCHEDULES if requested.schedule == "auto" else (requested.schedule,)
    checkpointing = (
        (False, True) if requested.activation_checkpointing is None else (requested.activation_checkpointing,)
    )
    mixes = []
    if requested.pipeline_stages == "auto" and requested.microbatches == "auto" and not streams:
        mixes = plan_mixed(
            profile,
            world_size=world_size,
            global_batch=global_batch,
            hardware=hardware,
            schedules=schedules,
            checkpointing=checkpointing,
        )
    try:
        candidates = plan_layouts(
            profile,
            world_size=world_size,
            global_batch=global_batch,
            hardware=hardware,
            schedules=schedules,
            checkpointing=checkpointing,
            pipeline_stages=fixed_p,
            offloads=requested.offloads,
        )
    except LayoutError:
        if not mixes:
            raise
        note = idle_note(profile, world_size, global_batch, hardware, mixes[0], schedules)
        return _mixed_draft(mixes, None, note, _fallback(requested).offload)
    if isinstance(requested.microbatches, int):
        fitting = [c for c in candidates if c.microbatches == requested.microbatches]
        if not fitting:
            d = world_size // candidates[0].pipeline_stages
            fitting = [
                evaluate(
                    profile,
                    pipeline_stages=candidates[0].pipeline_stages,
                    data_parallel=d,
                    microbatches=requested.microbatches,
                    global_batch=global_batch,
                    schedule=candidates[0].schedule,
                    hardware=hardware,
                    offload=tuple(candidates[0].offload),
                )
            ]
        candidates = fitting
    previous_now = _reevaluate(previous, profile, world_size, global_batch, hardware) if previous else None
    best, reason = keep_or_switch(candidates[0], previous, previous_now)
    # a plan kept from the last start is replaced only when clearly beaten (the same rule as for uniform plans)
    margin = PLAN_MARGIN if previous_now is not None and best is previous_now else MIXED_MARGIN
    if mixes and mixes[0].predicted_step_seconds < best.predicted_step_seconds * (1 - margin):
        note = idle_note(profile, world_size, global_batch, hardware, mixes[0], schedules)
        return _mixed_draft(mixes, best, note, _fallback(requested).offload)
    if requested.pipeline_stages == "auto":
        reason += idle_note(profile, world_size, global_batch, hardware, best, schedules)
    cuts = best.cuts if requested.partition in ("auto", "balanced") else None
    return _Draft(
        best.pipeline_stages,
        best.microbatches,
        best.schedule,
        best.activation_checkpointing,
        cuts,
        plan=best.to_dict(),
        runners_up=[c.to_dict() for c in candidates[:4] if c is not best][:3],
        reason=reason,
        offload=tuple(best.offload),
    )


#: a mix of pipeline depths is chosen over the best uniform layout only when predicted this much faster
MIXED_MARGIN = 0.03


def _mixed_draft(
    mixes: list[MixedCandidate], uniform: Candidate | None, note: str, offload: tuple[str, ...] = ()
) -> _Draft:
    """The planner's pick among pipelines of mixed depths, with why (the best uniform layout it beat)."""
    best = mixes[0]
    if uniform is None:
        why = f"no uniform layout of {sum(best.depths)} processes fits"
    else:
        gain = uniform.predicted_step_seconds / best.predicted_step_seconds - 1
        why = f"{gain:.0%} faster than the best uniform layout, {uniform.describe()}"
    lines = [f"pipelines of mixed depths {best.describe()}", f"  why: {why}{note}"]
    lines += [f"  runner-up: {c.describe()}" for c in mixes[1:4]]
    return _Draft(
        list(best.depths),
        list(best.microbatches),
        best.schedule,
        best.activation_checkpointing,
        [list(c) for c in best.cuts],
        reason="\n".join(lines),
        mixed_plan=best.to_dict(),
        offload=offload,
    )


def idle_note(
    profile: ModelProfile,
    world_size: int,
    global_batch: int,
    hardware: Hardware,
    chosen: MixedCandidate | Candidate,
    schedules: Sequence[str],
) -> str:
    """What idling processes would gain: the planner keeps every process training and says when fewer would do
    better (a uniform layout on the largest smaller world that has one)."""
    for fewer in range(world_size - 1, 0, -1):
        try:
            best = plan_layouts(
                profile, world_size=fewer, global_batch=global_batch, hardware=hardware, schedules=tuple(schedules)
            )[0]
        except LayoutError:
            continue
        gain = chosen.predicted_step_seconds / best.predicted_step_seconds - 1
        if gain > 0.001:
            return (
                f"; note: {best.describe()} on {fewer} of the {world_size} processes is predicted {gain:.1%} faster "
                f"(idling {world_size - fewer}); spot_pipeline keeps every process training"
            )
        return ""
    return ""


def _decide_mixed(profile: ModelProfile, requested: Requested, global_batch: int, hardware: Hardware) -> _Draft:
    """Pipelines of the requested mixed depths: cost-balanced cuts and predicted speeds to split the batch by."""
    draft = _fallback(requested)
    assert isinstance(requested.pipeline_stages, list)
    depths = [int(d) for d in requested.pipeline_stages]
    draft.activation_checkpointing = bool(requested.activation_checkpointing)
    m = requested.microbatches
    total = sum(m) if isinstance(m, list) else m if isinstance(m, int) else None
    total = total or total_microbatches(depths, draft.schedule, global_batch)
    if global_batch % total:
        return draft  # the data loader reports the indivisible batch with every way out
    cuts, seconds = mixed_cuts(
        profile,
        depths,
        samples=global_batch // total,
        schedule=draft.schedule,
        checkpointing=draft.activation_checkpointing,
        hardware=hardware,
    )
    counts = list(m) if isinstance(m, list) else split_microbatches(total, depths, seconds, draft.schedule)
    if requested.partition in ("auto", "balanced"):
        draft.cuts = cuts
    else:
        cuts = [plan_stages(len(profile.layers), d).cuts for d in depths]
    draft.microbatches = counts
    predicted = predict_mixed(
        profile,
        depths,
        counts,
        cuts,
        schedule=draft.schedule,
        checkpointing=draft.activation_checkpointing,
        samples=global_batch // total,
        hardware=hardware,
    )
    draft.mixed_plan = predicted.to_dict()
    draft.reason = f"pipelines of mixed depths {predicted.describe()}"
    return draft


def _reevaluate(
    previous: Candidate, profile: ModelProfile, world_size: int, global_batch: int, hardware: Hardware
) -> Candidate | None:
    """The previous plan's pipeline on this world, with today's profile and hardware (``None``: it does not fit)."""
    p, m = previous.pipeline_stages, previous.microbatches
    if world_size % p or global_batch % ((world_size // p) * m) or (previous.schedule == "1F1B" and m < p):
        return None
    if any(not 0 < c < len(profile.layers) for c in previous.cuts):
        return None  # (a cut count that does not fit the layout is refused by evaluate)
    try:
        again = evaluate(
            profile,
            pipeline_stages=p,
            data_parallel=world_size // p,
            microbatches=m,
            global_batch=global_batch,
            schedule=previous.schedule,
            checkpointing=previous.activation_checkpointing,
            offload=tuple(previous.offload),
            hardware=hardware,
            cuts=list(previous.cuts),
        )
    except LayoutError:
        return None
    fits = hardware.memory_bytes is None or max(again.stage_bytes) <= hardware.memory_bytes
    return again if fits else None


def describe_choice(choice: LayoutChoice) -> None:
    """Log the plan and its runners-up (rank 0), when the planner chose."""
    if choice.plan is None:
        if choice.layout.is_mixed and choice.reason:
            rank_zero_info(f"spot_pipeline plan: {choice.reason}")
        return
    best = Candidate(**choice.plan)
    lines = [f"spot_pipeline plan: {best.describe()}"]
    if choice.reason:
        lines.append(f"  why: {choice.reason}")
    lines += [f"  runner-up: {Candidate(**c).describe()}" for c in choice.runners_up]
    rank_zero_info("\n".join(lines))
