"""Pipeline schedule names, resolved case-insensitively to ``torch.distributed.pipelining`` classes.

    spec = resolve_schedule("1f1b")          # ScheduleSpec(name="1F1B", stages_per_rank=1, ...)
    spec = resolve_schedule("zbv")           # aliases are accepted too
    spec.cls                                  # torch.distributed.pipelining.Schedule1F1B
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch.distributed import pipelining as pp

from lightning_spot.layout import LayoutError


@dataclass(frozen=True)
class ScheduleSpec:
    """A schedule and how it places stages: ``stages_per_rank`` stages per rank, in loop or V order."""

    name: str
    stages_per_rank: int
    style: Literal["loop", "v"]
    #: schedules that split backward into input- and weight-gradient passes; DDP's hooks do not
    #: fire for the weight pass, so their gradients are all-reduced explicitly after the step.
    splits_backward: bool

    @property
    def cls(self) -> type:
        return getattr(pp, _TORCH_CLASS[self.name])

    @property
    def is_multi_stage(self) -> bool:
        return self.name not in ("GPipe", "1F1B")


_TORCH_CLASS = {
    "GPipe": "ScheduleGPipe",
    "1F1B": "Schedule1F1B",
    "Interleaved1F1B": "ScheduleInterleaved1F1B",
    "LoopedBFS": "ScheduleLoopedBFS",
    "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble",
    "ZBVZeroBubble": "ScheduleZBVZeroBubble",
    "DualPipeV": "ScheduleDualPipeV",
}
_SPECS = {
    "GPipe": ("loop", False),
    "1F1B": ("loop", False),
    "Interleaved1F1B": ("loop", False),
    "LoopedBFS": ("loop", False),
    "InterleavedZeroBubble": ("loop", True),
    "ZBVZeroBubble": ("v", True),
    "DualPipeV": ("v", True),
}
_ALIASES = {"zbv": "ZBVZeroBubble", "zerobubble": "InterleavedZeroBubble", "interleaved": "Interleaved1F1B"}

SCHEDULE_NAMES: tuple[str, ...] = tuple(n for n in _SPECS if hasattr(pp, _TORCH_CLASS[n]))


def _normalise(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "").replace("schedule", "")


def resolve_schedule(name: str, stages_per_rank: int | None = None) -> ScheduleSpec:
    """Resolve ``name`` (any case, ``-``/``_`` ignored) to a :class:`ScheduleSpec`.

    ``stages_per_rank`` applies to the looped schedules (default 2); V-shaped schedules always hold
    2 stages per rank and single-stage schedules 1.
    """
    wanted = _normalise(name)
    matches = [n for n in SCHEDULE_NAMES if _normalise(n) == wanted]
    if not matches and wanted in _ALIASES and _ALIASES[wanted] in SCHEDULE_NAMES:
        matches = [_ALIASES[wanted]]
    if not matches:
        raise LayoutError(f"Unknown pipeline schedule {name!r}. Choose one of: {', '.join(SCHEDULE_NAMES)}.")
    canonical = matches[0]
    style, splits = _SPECS[canonical]
    if canonical in ("GPipe", "1F1B"):
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
    return ScheduleSpec(canonical, per_rank, style, splits)
