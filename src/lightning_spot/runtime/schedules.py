"""Pipeline schedules: names resolved case-insensitively to ``torch.distributed.pipelining`` classes,
how each places stages on ranks, and the idle fraction (bubble) each should leave.

    spec = resolve_schedule("1f1b")          # ScheduleSpec(name="1F1B", stages_per_rank=1, ...)
    spec = resolve_schedule("zbv")           # aliases are accepted too
    spec.cls                                  # torch.distributed.pipelining.Schedule1F1B
    theoretical_bubble("1F1B", pipeline_ranks=4, stages_per_rank=1, microbatches=8)   # 3 / 11
    measured_bubble(step_seconds=0.30, compute_seconds=0.24)                           # 0.2
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from lightning_spot.layout import LayoutError
from lightning_spot.partition.cuts import Style

#: the schedules we run and test, by torch's names (``get_schedule_class`` resolves them)
_SUPPORTED = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
#: two facts torch only decides inside a schedule instance, so they are kept here:
#: stages placed in a V (rank 0 holds the first and the last stage) ...
_V_SHAPED = frozenset({"ZBVZeroBubble", "DualPipeV"})
#: ... and backward split into input- and weight-gradient passes (DDP's hooks miss the weight pass)
_SPLIT_BACKWARD = frozenset({"InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"})
_ALIASES = {"zbv": "ZBVZeroBubble", "zerobubble": "InterleavedZeroBubble", "interleaved": "Interleaved1F1B"}


def _available(name: str) -> bool:
    try:
        get_schedule_class(name)
    except ValueError:
        return False
    return True


SCHEDULE_NAMES: tuple[str, ...] = tuple(n for n in _SUPPORTED if _available(n))


@dataclass(frozen=True)
class ScheduleSpec:
    """A schedule and how it places stages: ``stages_per_rank`` stages per rank, in loop or V order."""

    name: str
    stages_per_rank: int
    style: Style
    #: schedules that split backward into input- and weight-gradient passes; DDP's hooks do not
    #: fire for the weight pass, so their gradients are all-reduced explicitly after the step.
    splits_backward: bool

    @property
    def cls(self) -> type:
        return get_schedule_class(self.name)

    @property
    def is_multi_stage(self) -> bool:
        return not issubclass(self.cls, PipelineScheduleSingle)


def _normalise(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "").replace("schedule", "")


def resolve_schedule(name: str, stages_per_rank: int | None = None) -> ScheduleSpec:
    """Resolve ``name`` (any case, ``-``/``_`` ignored) to a :class:`ScheduleSpec`.

    ``stages_per_rank`` applies to the looped schedules (default 2); V-shaped schedules always hold
    2 stages per rank and single-stage schedules 1.
    """
    wanted = _normalise(name)
    matches = [n for n in SCHEDULE_NAMES if _normalise(n) == wanted]
    if not matches and _ALIASES.get(wanted) in SCHEDULE_NAMES:
        matches = [_ALIASES[wanted]]
    if not matches:
        raise LayoutError(f"Unknown pipeline schedule {name!r}. Choose one of: {', '.join(SCHEDULE_NAMES)}.")
    canonical = matches[0]
    style: Style = "v" if canonical in _V_SHAPED else "loop"
    if issubclass(get_schedule_class(canonical), PipelineScheduleSingle):
        per_rank = 1
        if stages_per_rank not in (None, 1):
            raise LayoutError(
                f"schedule {canonical} runs one stage per rank; for stages_per_rank={stages_per_rank} "
                f"use 'Interleaved1F1B', 'LoopedBFS' or 'InterleavedZeroBubble'."
            )
    elif style == "v":
        per_rank = 2
        if stages_per_rank not in (None, 2):
            raise LayoutError(f"schedule {canonical} is V-shaped and always runs 2 stages per rank.")
    else:
        per_rank = 2 if stages_per_rank is None else int(stages_per_rank)
        if per_rank < 1:
            raise LayoutError(f"stages_per_rank must be >= 1, got {stages_per_rank}")
    return ScheduleSpec(canonical, per_rank, style, canonical in _SPLIT_BACKWARD)


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
    return base / 3 if schedule in _SPLIT_BACKWARD else base


def measured_bubble(step_seconds: float, compute_seconds: float) -> float:
    """The part of a rank's schedule time not spent computing (waiting on neighbours, sending, idle)."""
    if step_seconds <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - compute_seconds / step_seconds))
