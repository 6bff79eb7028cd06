"""Choose the pipeline depth P, data-parallel width D, micro-batches, schedule and activation
checkpointing that maximise predicted throughput, within the memory of a device.

    best, *runner_ups = plan_layouts(profile, world_size=16, global_batch=256, hardware=Hardware(memory_bytes=80e9))
    best.pipeline_stages, best.cuts, best.predicted_step_seconds

Every candidate gets cost-balanced cuts (``partition.balance``) that fit the memory, and a step
time from a pipeline model: the stages' compute from the profile (fill and drain through every
stage, then the bottleneck stage once per remaining micro-batch), point-to-point transfers of the
activations, the data-parallel all-reduce of each stage's gradients and the optimizer update.
Communication speeds come from :class:`Hardware` (measured on the job's process group by
:func:`measure_hardware`, or given).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from lightning_spot.layout import Layout, LayoutError, PipelineLayout
from lightning_spot.partition.balance import balanced_cuts
from lightning_spot.planning.hardware import Hardware
from lightning_spot.planning.profile import LayerProfile, ModelProfile
from lightning_spot.utils.units import divisors, format_bytes

PLANNED_SCHEDULES = ("1F1B", "GPipe")
#: what ``offload="auto"`` tries, cheapest first
OFFLOAD_CHOICES: tuple[tuple[str, ...], ...] = (
    (),
    ("activations",),
    ("optimizer",),
    ("optimizer", "activations"),
    ("optimizer", "parameters"),
    ("optimizer", "parameters", "activations"),
)


@dataclass
class Candidate:
    """One evaluated layout; ``stage_seconds`` is each stage's compute per step."""

    pipeline_stages: int
    data_parallel: int
    microbatches: int
    schedule: str
    activation_checkpointing: bool
    cuts: list[int]
    stage_seconds: list[float]
    stage_bytes: list[int]
    predicted_step_seconds: float
    samples_per_second: float
    detail: dict[str, float] = field(default_factory=dict)
    #: training state kept in host memory (``"optimizer"``, ``"activations"``)
    offload: list[str] = field(default_factory=list)

    @property
    def layout(self) -> PipelineLayout:
        """The layout this candidate stands for (one stage per rank, or with streamed weights LoopedBFS's)."""
        grid = Layout(self.pipeline_stages, self.data_parallel)
        return PipelineLayout(grid, self.schedule, len(self.cuts) + 1, tuple(self.cuts), self.microbatches)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        ac = ", activation checkpointing" if self.activation_checkpointing else ""
        ac += f", offload {'+'.join(self.offload)}" if self.offload else ""
        return (
            f"{self.layout.grid}, {self.microbatches} micro-batches, {self.schedule}{ac}: "
            f"{self.predicted_step_seconds * 1000:.1f} ms/step ({self.samples_per_second:.1f} samples/s), "
            f"max {format_bytes(max(self.stage_bytes))} per device, cuts {self.cuts}"
        )


def in_flight(schedule: str, stage: int, stages: int, microbatches: int) -> int:
    """Micro-batches whose activations a stage holds at once (GPipe: all; 1F1B: the pipeline depth ahead)."""
    if schedule == "GPipe":
        return microbatches
    return min(microbatches, stages - stage)


def _stage_profile(profile: ModelProfile, stage: int, stages: int, a: int, b: int) -> list[LayerProfile]:
    layers = list(profile.layers[a:b])
    if stage == 0:
        layers.append(profile.first)
    if stage == stages - 1:
        layers.append(profile.last)
    return layers


def stage_bytes(
    profile: ModelProfile,
    stage: int,
    stages: int,
    a: int,
    b: int,
    *,
    schedule: str,
    microbatches: int,
    checkpointing: bool,
    hardware: Hardware,
    offload: tuple[str, ...] = (),
) -> float:
    """Device memory of a stage holding layers ``[a, b)`` (profile already scaled to the micro-batch size).

    With the optimizer offloaded the device keeps weights and gradients only; with activations offloaded, one
    micro-batch's saved activations at a time (the others wait in host memory).
    """
    layers = _stage_profile(profile, stage, stages, a, b)
    state = sum(p.param_bytes for p in layers) * (2 if "optimizer" in offload else hardware.state_factor)
    if checkpointing:  # keep each layer's input; recompute one layer at a time in backward
        per_microbatch = sum(p.output_bytes for p in profile.layers[max(a - 1, 0) : b]) + max(
            p.saved_bytes for p in layers
        )
    else:
        per_microbatch = sum(p.saved_bytes for p in layers)
    buffers = 2 * (profile.layers[b - 1].output_bytes + (profile.layers[a - 1].output_bytes if a else 0))
    held = 1 if "activations" in offload else in_flight(schedule, stage, stages, microbatches)
    return state + held * per_microbatch + buffers


def host_bytes(
    profile: ModelProfile,
    stage: int,
    stages: int,
    a: int,
    b: int,
    *,
    schedule: str,
    microbatches: int,
    hardware: Hardware,
    offload: tuple[str, ...],
) -> float:
    """Host memory a stage's offloaded state takes: fp32 masters and optimizer state, saved activations."""
    layers = _stage_profile(profile, stage, stages, a, b)
    total = 0.0
    if "optimizer" in offload:
        total += sum(p.param_bytes for p in layers) * (hardware.state_factor - 1)
    if "activations" in offload:
        total += in_flight(schedule, stage, stages, microbatches) * sum(p.saved_bytes for p in layers)
    return total


def _stage_seconds(layers: list[LayerProfile], checkpointing: bool, hardware: Hardware) -> float:
    forward = sum(p.forward_s for p in layers)
    backward = sum(p.backward_s for p in layers) + (forward if checkpointing else 0.0)
    return (forward + backward) * hardware.compute_slowdown + hardware.microbatch_overhead_s


def predict_step_seconds(
    profile: ModelProfile,
    cuts: list[int],
    *,
    data_parallel: int,
    microbatches: int,
    checkpointing: bool,
    hardware: Hardware,
    offload: tuple[str, ...] = (),
) -> tuple[float, list[float], dict[str, float]]:
    """(step seconds, each stage's compute per step, breakdown) for one layout; ``profile`` at micro-batch size.

    Offloaded activations cost each micro-batch a copy out and back of what its stage saves; an offloaded
    optimizer, a copy of the gradients out and of the weights back, and the update at the host's speed.
    """
    stages = len(cuts) + 1
    bounds = [0, *cuts, len(profile.layers)]
    # processes sharing cores (CPUs) slow each other down only while they compute: a pipeline's
    # stages idle for the bubble, data-parallel replicas all update their weights at once
    busy = 1.0 - (stages - 1) / (microbatches + stages - 1)
    computing = replace(hardware, compute_slowdown=max(1.0, hardware.compute_slowdown * busy))
    per_mb, comm, grads = [], [], []
    for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
        layers = _stage_profile(profile, s, stages, a, b)
        seconds = _stage_seconds(layers, checkpointing, computing)
        if "activations" in offload:
            seconds += 2 * sum(p.saved_bytes for p in layers) / hardware.host_copy_bytes_per_s
        per_mb.append(seconds)
        out = profile.layers[b - 1].output_bytes if s < stages - 1 else 0
        comm.append(hardware.p2p_latency_s + out / hardware.p2p_bytes_per_s if out else 0.0)
        grads.append(sum(p.param_bytes for p in layers))
    pipeline = sum(per_mb) + 2 * sum(comm) + (microbatches - 1) * max(t + 2 * c for t, c in zip(per_mb, comm))
    allreduce = max(_allreduce_seconds(g, data_parallel, hardware) for g in grads)
    if "optimizer" in offload:
        optimizer = max(
            g * hardware.state_factor / hardware.host_optimizer_bytes_per_s + 2 * g / hardware.host_copy_bytes_per_s
            for g in grads
        )
    else:
        optimizer = (
            max(g * hardware.state_factor for g in grads) / hardware.optimizer_bytes_per_s * hardware.compute_slowdown
        )
    total = pipeline + allreduce + optimizer + hardware.step_overhead_s
    return (
        total,
        [t * microbatches for t in per_mb],
        {
            "pipeline": pipeline,
            "allreduce": allreduce,
            "optimizer": optimizer,
            "overhead": hardware.step_overhead_s,
        },
    )


def _allreduce_seconds(nbytes: float, data_parallel: int, hardware: Hardware, collectives: int = 1) -> float:
    """A ring all-reduce of ``nbytes`` over ``data_parallel`` replicas, in ``collectives`` calls (0 for D = 1)."""
    if data_parallel <= 1:
        return 0.0
    ring = 2 * (data_parallel - 1) / data_parallel
    return ring * nbytes / hardware.allreduce_bytes_per_s + 2 * collectives * (data_parallel - 1) * (
        hardware.allreduce_latency_s
    )


def _check_host_memory(needed: float, hardware: Hardware, offload: tuple[str, ...]) -> None:
    """Raise when the offloaded state of a process does not fit its host memory (when that is known)."""
    if hardware.host_memory_bytes is not None and needed > hardware.host_memory_bytes:
        raise LayoutError(
            f"offloading {'+'.join(offload)} needs {format_bytes(needed)} of host memory per process, more than "
            f"the {format_bytes(hardware.host_memory_bytes)} available"
        )


def evaluate(
    profile: ModelProfile,
    *,
    pipeline_stages: int,
    data_parallel: int,
    microbatches: int,
    global_batch: int,
    schedule: str = "1F1B",
    checkpointing: bool = False,
    hardware: Hardware = Hardware(),
    cuts: list[int] | None = None,
    offload: tuple[str, ...] = (),
) -> Candidate:
    """Cost-balanced cuts (or the given ``cuts``) and the predicted step for one layout; raises if it does not
    fit the device memory, or (with ``offload``) the host memory. With the weights streamed (``"parameters"``)
    the layout is :func:`evaluate_streamed`'s (LoopedBFS; ``schedule`` does not apply)."""
    if "parameters" in offload:
        return evaluate_streamed(
            profile,
            pipeline_stages=pipeline_stages,
            data_parallel=data_parallel,
            microbatches=microbatches,
            global_batch=global_batch,
            checkpointing=checkpointing,
            hardware=hardware,
            cuts=cuts,
            offload=offload,
        )
    if cuts is not None and len(cuts) != pipeline_stages - 1:
        raise LayoutError(f"{len(cuts)} cuts do not make {pipeline_stages} pipeline stages")
    samples = global_batch // (data_parallel * microbatches)
    scaled = profile.scaled(samples)

    def memory(stage: int, a: int, b: int) -> float:
        return stage_bytes(
            scaled,
            stage,
            pipeline_stages,
            a,
            b,
            schedule=schedule,
            microbatches=microbatches,
            checkpointing=checkpointing,
            hardware=hardware,
            offload=offload,
        )

    if cuts is None:
        times = [_stage_seconds([p], checkpointing, hardware) - hardware.microbatch_overhead_s for p in scaled.layers]
        cuts = balanced_cuts(
            times,
            pipeline_stages,
            first_extra=_stage_seconds([scaled.first], checkpointing, hardware) - hardware.microbatch_overhead_s,
            last_extra=_stage_seconds([scaled.last], checkpointing, hardware) - hardware.microbatch_overhead_s,
            stage_bytes=memory,
            capacity=hardware.memory_bytes,
        )
    bounds = [0, *cuts, len(scaled.layers)]
    if offload and hardware.host_memory_bytes is not None:
        host = max(
            host_bytes(
                scaled,
                s,
                pipeline_stages,
                a,
                b,
                schedule=schedule,
                microbatches=microbatches,
                hardware=hardware,
                offload=offload,
            )
            for s, (a, b) in enumerate(zip(bounds, bounds[1:]))
        )
        _check_host_memory(host, hardware, offload)
    step, stage_secs, detail = predict_step_seconds(
        scaled,
        cuts,
        data_parallel=data_parallel,
        microbatches=microbatches,
        checkpointing=checkpointing,
        hardware=hardware,
        offload=offload,
    )
    return Candidate(
        pipeline_stages,
        data_parallel,
        microbatches,
        schedule,
        checkpointing,
        list(cuts),
        stage_secs,
        [int(memory(s, a, b)) for s, (a, b) in enumerate(zip(bounds, bounds[1:]))],
        step,
        global_batch / step,
        detail,
        list(offload),
    )


def plan_layouts(
    profile: ModelProfile,
    *,
    world_size: int,
    global_batch: int,
    hardware: Hardware = Hardware(),
    schedules: tuple[str, ...] = PLANNED_SCHEDULES,
    checkpointing: tuple[bool, ...] = (False, True),
    pipeline_stages: int | None = None,
    max_microbatches: int = 64,
    offloads: tuple[tuple[str, ...], ...] = ((),),
) -> list[Candidate]:
    """Every feasible layout for ``world_size`` devices, best (highest predicted throughput) first.

    ``pipeline_stages`` fixes P (then only micro-batches, schedule and checkpointing are chosen).
    Raises :class:`LayoutError` listing why when nothing fits.
    """
    n = len(profile.layers)
    if pipeline_stages is not None and (pipeline_stages < 1 or world_size % pipeline_stages):
        raise LayoutError(f"pipeline_stages={pipeline_stages} does not divide the world size {world_size}")
    found: list[Candidate] = []
    smallest: tuple[float, str] | None = None
    depths = [pipeline_stages] if pipeline_stages else [p for p in divisors(world_size) if p <= n]
    for p in depths:
        d = world_size // p
        if global_batch % d:
            continue
        for m in divisors(global_batch // d):
            if m > max_microbatches:
                break
            for schedule in schedules:
                if (schedule == "1F1B" and m < p) or (schedule == "GPipe" and p == 1 and "1F1B" in schedules):
                    continue  # 1F1B needs M >= P; with one stage GPipe and 1F1B are the same
                for ac, offload in itertools.product(checkpointing, offloads):
                    streamed = "parameters" in offload
                    if streamed and (schedule != schedules[0] or p > n):
                        continue  # weights streamed: one schedule of their own (LoopedBFS), tried once
                    trial = functools.partial(
                        evaluate,
                        profile,
                        pipeline_stages=p,
                        data_parallel=d,
                        microbatches=m,
                        global_batch=global_batch,
                        schedule=schedule,
                        checkpointing=ac,
                        offload=offload,
                    )
                    try:
                        found.append(trial(hardware=hardware))
                    except LayoutError:
                        unbounded = replace(hardware, memory_bytes=None, host_memory_bytes=None)
                        need = float(max(trial(hardware=unbounded).stage_bytes))
                        if smallest is None or need < smallest[0]:
                            shown = "LoopedBFS" if streamed else schedule
                            label = f"{Layout(p, d)} {shown} M={m}{', activation checkpointing' if ac else ''}"
                            label += f", offload {'+'.join(offload)}" if offload else ""
                            smallest = (need, label)
    if not found:
        hint = (
            f" The least memory any layout needs is {format_bytes(smallest[0])} per device ({smallest[1]})."
            if smallest
            else ""
        )
        if any(offloads):
            host = format_bytes(hardware.host_memory_bytes) if hardware.host_memory_bytes else "unknown"
            hint += f" Keeping training state in host memory was considered (host memory per process: {host})."
        raise LayoutError(
            f"No layout of {world_size} devices fits a global batch of {global_batch} samples in "
            f"{format_bytes(hardware.memory_bytes)} per device.{hint} Use more devices, devices with more memory, "
            f"or a smaller global batch."
        )
    if any("parameters" not in c.offload for c in found):
        # streaming the weights is the last resort: its copies' overlap with compute is modelled, not yet measured
        found = [c for c in found if "parameters" not in c.offload]
    found.sort(key=lambda c: (c.predicted_step_seconds, max(c.stage_bytes)))
    return found


def evaluate_streamed(
    profile: ModelProfile,
    *,
    pipeline_stages: int,
    data_parallel: int,
    microbatches: int,
    global_batch: int,
    checkpointing: bool = False,
    hardware: Hardware = Hardware(),
    cuts: list[int] | None = None,
    offload: tuple[str, ...] = ("optimizer", "parameters"),
) -> Candidate:
    """A layout with the weights streamed (``offload="parameters"``): LoopedBFS, one layer per stage as far as
    the layers allow (or the given ``cuts``), rank ``r`` holding stages ``r, r + P, ...``. Raises if it does not
    fit the device or host.

    Device memory per rank: the two largest local stages' weights and gradients (the active one and the
    prefetched one), the modules beside the layer sequence (weights and gradients), every micro-batch's saved
    activations of the rank's layers (breadth-first runs all forwards before the backwards; one layer's and one
    micro-batch's with ``"activations"``; layer inputs only with checkpointing) and the send/receive buffers.
    Time: the bottleneck rank's compute stretched by the looped schedule's bubble, the copies (weights twice,
    gradients once per step) where they outrun the compute they overlap with, plus one stage's load that
    nothing hides, the per-stage gradient average, and the update on the host.
    """
    p, m = pipeline_stages, microbatches
    n = len(profile.layers)
    if n < p:
        raise LayoutError(f"{n} layers cannot fill {p} pipeline stages")
    per_rank = n // p
    stages = p * per_rank
    samples = global_batch // (data_parallel * m)
    scaled = profile.scaled(samples)
    if cuts is not None and len(cuts) != stages - 1:
        raise LayoutError(f"{len(cuts)} cuts do not make {stages} stages of one or a few layers")
    if cuts is None:
        times = [_stage_seconds([x], checkpointing, hardware) - hardware.microbatch_overhead_s for x in scaled.layers]
        cuts = balanced_cuts(times, stages) if stages < n else list(range(1, n))
    bounds = [0, *cuts, n]
    spans = list(zip(bounds, bounds[1:]))
    last_rank = (stages - 1) % p
    device, host, compute, copies, grads, first_load = [], [], [], [], [], []
    for r in range(p):
        local = [spans[s] for s in range(r, stages, p)]
        layers = [scaled.layers[i] for a, b in local for i in range(a, b)]
        weights = [sum(scaled.layers[i].param_bytes for i in range(a, b)) for a, b in local]
        outer = [x for x, holds in ((scaled.first, r == 0), (scaled.last, r == last_rank)) if holds]
        two = sum(sorted(weights)[-2:])
        if "activations" in offload:
            saved = max(x.saved_bytes for x in layers)
        elif checkpointing:
            saved = m * sum(x.output_bytes for x in layers) + max(x.saved_bytes for x in layers)
        else:
            saved = m * sum(x.saved_bytes for x in layers)
        buffers = 2 * m * sum(scaled.layers[b - 1].output_bytes for _, b in local)
        device.append(2 * two + 2 * sum(x.param_bytes for x in outer) + saved + buffers)
        host.append(
            sum(weights) * hardware.state_factor
            + (m * sum(x.saved_bytes for x in layers) if "activations" in offload else 0)
        )
        seconds = m * sum(_stage_seconds([x], checkpointing, hardware) for x in [*layers, *outer])
        if "activations" in offload:
            seconds += 2 * m * sum(x.saved_bytes for x in layers) / hardware.host_copy_bytes_per_s
        compute.append(seconds * hardware.compute_slowdown)
        copies.append(3 * sum(weights) / hardware.host_copy_bytes_per_s)
        first_load.append(max(weights) / hardware.host_copy_bytes_per_s)
        grads.append(sum(weights) + sum(x.param_bytes for x in outer))
    fits = hardware.memory_bytes is None or max(device) <= hardware.memory_bytes
    if not fits:
        raise LayoutError(f"streamed weights: {format_bytes(max(device))} per device do not fit")
    _check_host_memory(max(host), hardware, offload)
    stretch = (per_rank * m + p - 1) / (per_rank * m)
    pipeline = max(stretch * c + max(0.0, k - c) + f for c, k, f in zip(compute, copies, first_load))
    allreduce = max(_allreduce_seconds(g, data_parallel, hardware, collectives=per_rank) for g in grads)
    optimizer = max(g * hardware.state_factor for g in grads) / hardware.host_optimizer_bytes_per_s
    step = pipeline + allreduce + optimizer + hardware.step_overhead_s
    return Candidate(
        p,
        data_parallel,
        m,
        "LoopedBFS",
        checkpointing,
        cuts,
        compute,
        [int(b) for b in device],
        step,
        global_batch / step,
        {"pipeline": pipeline, "allreduce": allreduce, "optimizer": optimizer, "overhead": hardware.step_overhead_s},
        list(offload),
    )
