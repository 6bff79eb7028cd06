"""Cut a layer sequence into contiguous pipeline stages and place the stages on ranks.

    plan = plan_stages(num_layers=12, pp_size=4)                   # even: 3 layers per stage
    plan = plan_stages(12, 2, cuts=[5])                             # explicit: [0:5], [5:12]
    plan = plan_stages(12, 2, stages_per_rank=2, style="v")         # ZBV: rank 0 holds stages 0 and 3

``cuts`` are the indices of the first layer of every stage but the first, as in
``torchgpipe``'s balance lists turned into boundaries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from lightning_spot.layout import LayoutError

Style = Literal["loop", "v"]


def even_cuts(num_layers: int, num_stages: int) -> list[int]:
    """Boundaries that split ``num_layers`` into ``num_stages`` runs differing by at most one layer.

    Earlier stages get the extra layers; the last stage also runs the head and the loss.
    """
    base, extra = divmod(num_layers, num_stages)
    cuts, start = [], 0
    for stage in range(num_stages - 1):
        start += base + (1 if stage < extra else 0)
        cuts.append(start)
    return cuts


@dataclass(frozen=True)
class StagePlan:
    """``num_stages`` contiguous layer ranges and the pipeline rank each runs on."""

    bounds: tuple[int, ...]
    pp_size: int
    style: Style = "loop"

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    @property
    def cuts(self) -> list[int]:
        return list(self.bounds[1:-1])

    def layers_of(self, stage: int) -> range:
        return range(self.bounds[stage], self.bounds[stage + 1])

    def rank_of_stage(self, stage: int) -> int:
        if self.style == "loop":
            return stage % self.pp_size
        lap, pos = divmod(stage, self.pp_size)
        return pos if lap % 2 == 0 else self.pp_size - 1 - pos

    def stages_of_rank(self, pp_rank: int) -> list[int]:
        return [s for s in range(self.num_stages) if self.rank_of_stage(s) == pp_rank]

    def stage_of_layer(self, layer: int) -> int:
        for stage in range(self.num_stages):
            if layer < self.bounds[stage + 1]:
                return stage
        raise IndexError(layer)


def plan_stages(
    num_layers: int,
    pp_size: int,
    *,
    stages_per_rank: int = 1,
    style: Style = "loop",
    cuts: Sequence[int] | None = None,
) -> StagePlan:
    """Split ``num_layers`` layers into ``pp_size * stages_per_rank`` stages (even, or at ``cuts``)."""
    num_stages = pp_size * stages_per_rank
    if num_stages > num_layers:
        raise LayoutError(
            f"{num_stages} pipeline stages ({pp_size} ranks x {stages_per_rank} stages per rank) need at least "
            f"{num_stages} layers, but the layer sequence has {num_layers}. Use fewer pipeline_stages "
            f"(at most {num_layers // stages_per_rank}), a schedule with one stage per rank, or a model with more layers."
        )
    if cuts is None:
        cuts = even_cuts(num_layers, num_stages)
    else:
        cuts = [int(c) for c in cuts]
        if len(cuts) != num_stages - 1:
            raise LayoutError(
                f"cuts={cuts} gives {len(cuts) + 1} stages but the layout needs {num_stages} "
                f"({pp_size} ranks x {stages_per_rank}); pass {num_stages - 1} cut indices, e.g. "
                f"{even_cuts(num_layers, num_stages)}."
            )
        if any(b <= a for a, b in zip([0, *cuts], [*cuts, num_layers])):
            raise LayoutError(
                f"cuts={cuts} must be strictly increasing indices between 1 and {num_layers - 1} "
                f"so that every stage gets at least one layer, e.g. {even_cuts(num_layers, num_stages)}."
            )
    return StagePlan(bounds=(0, *cuts, num_layers), pp_size=pp_size, style=style)
