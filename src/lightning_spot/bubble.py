"""The idle fraction of a pipeline step: what a schedule should leave idle, and what a rank measured.

    theoretical_bubble("1F1B", pipeline_ranks=4, stages_per_rank=1, microbatches=8)   # 3 / 11
    measured_bubble(step_seconds=0.30, compute_seconds=0.24)                           # 0.2
"""

from __future__ import annotations


def theoretical_bubble(schedule: str, pipeline_ranks: int, stages_per_rank: int, microbatches: int) -> float:
    """The schedule's textbook bubble fraction, for equal stages and backward = 2 x forward.

    GPipe / 1F1B: (P-1) / (M+P-1); looped and interleaved schedules with v stages per rank:
    (P-1) / (vM+P-1); zero-bubble schedules, which fill the drain with weight-gradient work, are
    modelled as a third of their interleaved counterpart (ZB-H1, Qi et al. 2023).
    """
    p, v, m = pipeline_ranks, max(stages_per_rank, 1), max(microbatches, 1)
    if p <= 1:
        return 0.0
    base = (p - 1) / (v * m + p - 1)
    if "zerobubble" in schedule.lower() or schedule in ("DualPipeV",):
        return base / 3
    return base


def measured_bubble(step_seconds: float, compute_seconds: float) -> float:
    """The part of a rank's schedule time not spent computing (waiting on neighbours, sending, idle)."""
    if step_seconds <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - compute_seconds / step_seconds))
