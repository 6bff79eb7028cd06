"""Pipelines of mixed depths: cut each one, and split the global batch in proportion to their speed.

    cuts, per_mb = mixed_cuts(profile, depths=[2, 3], samples=8, schedule="1F1B", hardware=hw)
    split_microbatches(8, depths=[2, 3], stage_seconds=per_mb, schedule="1F1B")    # -> e.g. [3, 5]
    best = plan_mixed(profile, world_size=5, global_batch=64, hardware=hw)[0]      # the planner's mixes

A pipeline of depth ``p`` whose slowest stage takes ``s`` per micro-batch runs ``m`` micro-batches in
about ``(m + p - 1) x s`` (fill, steady state, drain). The step waits for the slowest pipeline, so
micro-batches go one at a time to the pipeline that would finish them soonest: the split that
minimises the slowest pipeline's time. All micro-batches have the same size, so weighting each by
one keeps the step's gradient the mean over the global batch whatever the split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from lightning_spot.layout import LayoutError
from lightning_spot.partition.cuts import even_cuts
from lightning_spot.planning.cost_model import PLANNED_SCHEDULES, evaluate
from lightning_spot.planning.hardware import Hardware
from lightning_spot.planning.profile import ModelProfile
from lightning_spot.utils.units import divisors, format_bytes


def fewest_microbatches(depth: int, schedule: str) -> int:
    """The fewest micro-batches a pipeline of ``depth`` can run (1F1B needs one per stage)."""
    return depth if schedule == "1F1B" else 1


def pipeline_seconds(microbatches: int, depth: int, stage_seconds: float) -> float:
    """Predicted time of one pipeline's step: fill and drain (``depth - 1``) plus one slot per micro-batch."""
    return (microbatches + depth - 1) * stage_seconds if microbatches else 0.0


def split_microbatches(
    total: int, depths: Sequence[int], stage_seconds: Sequence[float], schedule: str = "1F1B"
) -> list[int]:
    """Give ``total`` micro-batches to pipelines of ``depths`` (slowest stage ``stage_seconds`` per micro-batch)
    so that the slowest pipeline finishes as early as possible; each gets at least what its schedule needs."""
    counts = [fewest_microbatches(d, schedule) for d in depths]
    if total < sum(counts):
        raise LayoutError(
            f"{total} micro-batches per step cannot feed pipelines of depths {list(depths)} with {schedule}: they "
            f"need at least {sum(counts)} ({'+'.join(map(str, counts))}). Use more micro-batches "
            f"(and a global batch divisible by their number)."
        )
    for _ in range(total - sum(counts)):
        best = min(
            range(len(depths)),
            key=lambda i: (pipeline_seconds(counts[i] + 1, depths[i], stage_seconds[i]), -depths[i], i),
        )
        counts[best] += 1
    return counts


def layer_count_seconds(num_layers: int, depth: int, cuts: Sequence[int] | None = None) -> float:
    """Without a profile: the slowest stage's layer count (every layer costs the same)."""
    bounds = [0, *(cuts if cuts is not None else even_cuts(num_layers, depth)), num_layers]
    return float(max(b - a for a, b in zip(bounds, bounds[1:])))


def total_microbatches(depths: Sequence[int], schedule: str, global_batch: int | None) -> int:
    """Micro-batches per step when nobody chose: the fewest that are at least two per process, feed every
    pipeline's schedule and divide the global batch (the global batch itself when none does)."""
    target = max(2 * sum(depths), sum(fewest_microbatches(d, schedule) for d in depths))
    if global_batch is None:
        return target
    fitting = [d for d in divisors(global_batch) if d >= target]
    return fitting[0] if fitting else global_batch


def mixed_cuts(
    profile: ModelProfile,
    depths: Sequence[int],
    *,
    samples: int,
    schedule: str,
    checkpointing: bool,
    hardware: Hardware,
) -> tuple[list[list[int]], list[float]]:
    """Cost-balanced cuts of every pipeline (each stage within device memory) and each pipeline's slowest
    stage per micro-batch of ``samples``; raises :class:`LayoutError` when a pipeline does not fit."""
    cuts, per_microbatch = [], []
    for depth in depths:
        m = depth  # what each stage keeps in flight under 1F1B; the cuts do not depend on it otherwise
        candidate = evaluate(  # balanced cuts within the memory budget (raises LayoutError when none fits)
            profile,
            pipeline_stages=depth,
            data_parallel=1,
            microbatches=m,
            global_batch=samples * m,
            schedule=schedule,
            checkpointing=checkpointing,
            hardware=hardware,
        )
        cuts.append(list(candidate.cuts))
        per_microbatch.append(max(candidate.stage_seconds) / m)
    return cuts, per_microbatch


@dataclass
class MixedCandidate:
    """One evaluated layout of pipelines of mixed depths (the step waits for the slowest pipeline)."""

    depths: list[int]
    microbatches: list[int]
    schedule: str
    activation_checkpointing: bool
    cuts: list[list[int]]
    pipeline_seconds: list[float]
    stage_bytes: int  # the largest stage's memory
    predicted_step_seconds: float
    samples_per_second: float

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        ac = ", activation checkpointing" if self.activation_checkpointing else ""
        times = ", ".join(f"{t * 1000:.1f}" for t in self.pipeline_seconds)
        return (
            f"{'+'.join(f'P{d}' for d in self.depths)}, {'+'.join(map(str, self.microbatches))} micro-batches, "
            f"{self.schedule}{ac}: {self.predicted_step_seconds * 1000:.1f} ms/step ({self.samples_per_second:.1f} "
            f"samples/s; pipelines {times} ms), max {format_bytes(self.stage_bytes)} per device, "
            f"cuts {' | '.join(str(c) for c in self.cuts)}"
        )


def depth_mixes(world_size: int, deepest: int, limit: int = 24) -> list[list[int]]:
    """Pipelines of two different depths (at most ``deepest``) that use all ``world_size`` processes, closest
    depths first (at most ``limit``): ``depth_mixes(5, 4)`` -> [[2, 3], [1, 1, 1, 2], [1, 2, 2], [1, 4], ...]."""
    mixes = []
    for a in range(1, deepest + 1):
        for b in range(a + 1, deepest + 1):
            for x in range(1, world_size // a + 1):
                rest = world_size - x * a
                if rest > 0 and rest % b == 0:
                    mixes.append([a] * x + [b] * (rest // b))
    mixes.sort(key=lambda m: (max(m) - min(m), len(m)))
    return mixes[:limit]


def predict_mixed(
    profile: ModelProfile,
    depths: Sequence[int],
    microbatches: Sequence[int],
    cuts: Sequence[Sequence[int]],
    *,
    schedule: str,
    checkpointing: bool,
    samples: int,
    hardware: Hardware,
) -> MixedCandidate:
    """The predicted step of one mix: each pipeline as in a uniform layout of as many replicas (the all-reduce
    included), the step as long as the slowest pipeline."""
    n = len(depths)
    per_pipeline = [
        evaluate(
            profile,
            pipeline_stages=d,
            data_parallel=n,
            microbatches=m,
            global_batch=samples * m * n,
            schedule=schedule,
            checkpointing=checkpointing,
            hardware=hardware,
            cuts=list(c),
        )
        for d, m, c in zip(depths, microbatches, cuts)
    ]
    step = max(c.predicted_step_seconds for c in per_pipeline)
    return MixedCandidate(
        list(depths),
        list(microbatches),
        schedule,
        checkpointing,
        [list(c) for c in cuts],
        [c.predicted_step_seconds for c in per_pipeline],
        int(max(max(c.stage_bytes) for c in per_pipeline)),
        step,
        samples * sum(microbatches) / step,
    )


def plan_mixed(
    profile: ModelProfile,
    *,
    world_size: int,
    global_batch: int,
    hardware: Hardware,
    schedules: Sequence[str] = PLANNED_SCHEDULES,
    checkpointing: Sequence[bool] = (False, True),
    max_microbatches: int = 64,
) -> list[MixedCandidate]:
    """Every feasible layout of pipelines of mixed depths for ``world_size`` processes, best first (may be empty).

    Each pipeline gets cost-balanced cuts within the memory, the micro-batches are split by predicted speed,
    and each pipeline's step is predicted as for a uniform layout of as many replicas (the all-reduce included).
    """
    found: list[MixedCandidate] = []
    for depths in depth_mixes(world_size, len(profile.layers)):
        n = len(depths)
        for schedule in schedules:
            least = sum(fewest_microbatches(d, schedule) for d in depths)
            for ac in checkpointing:
                for total in divisors(global_batch):
                    if total < least:
                        continue
                    if total > max_microbatches * n:
                        break
                    samples = global_batch // total
                    try:
                        cuts, seconds = mixed_cuts(
                            profile, depths, samples=samples, schedule=schedule, checkpointing=ac, hardware=hardware
                        )
                    except LayoutError:
                        continue
                    counts = split_microbatches(total, depths, seconds, schedule)
                    candidate = predict_mixed(
                        profile,
                        depths,
                        counts,
                        cuts,
                        schedule=schedule,
                        checkpointing=ac,
                        samples=samples,
                        hardware=hardware,
                    )
                    if hardware.memory_bytes is None or candidate.stage_bytes <= hardware.memory_bytes:
                        found.append(candidate)
    found.sort(key=lambda c: (c.predicted_step_seconds, c.stage_bytes))
    return found
