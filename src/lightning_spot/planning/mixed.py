"""Pipelines of mixed depths: cut each one, and split the global batch in proportion to their speed.

    cuts, per_mb = mixed_cuts(profile, depths=[2, 3], samples=8, schedule="1F1B", hardware=hw)
    split_microbatches(8, depths=[2, 3], stage_seconds=per_mb, schedule="1F1B")    # -> e.g. [3, 5]

A pipeline of depth ``p`` whose slowest stage takes ``s`` per micro-batch runs ``m`` micro-batches in
about ``(m + p - 1) x s`` (fill, steady state, drain). The step waits for the slowest pipeline, so
micro-batches go one at a time to the pipeline that would finish them soonest: the split that
minimises the slowest pipeline's time. All micro-batches have the same size, so weighting each by
one keeps the step's gradient the mean over the global batch whatever the split.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_spot._units import divisors
from lightning_spot.layout import LayoutError
from lightning_spot.partition.cuts import even_cuts
from lightning_spot.planning.cost_model import evaluate
from lightning_spot.planning.hardware import Hardware
from lightning_spot.planning.profile import ModelProfile


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
