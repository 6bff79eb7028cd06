"""The layout of a job: its process grid (P x D, or pipelines of mixed depths) and the whole :class:`PipelineLayout`.

    grid = Layout.for_world(world_size=8, pipeline_stages=4)   # P=4, D=2
    mesh = grid.device_mesh("cuda")                             # dims ("pp", "dp")
    grid.pp_rank(5), grid.dp_rank(5)                            # -> (2, 1): stage position, pipeline (replica)
    mixed = Layout.for_world(5, [2, 3])                         # two pipelines, depths 2 and 3: "P2+P3"
    mixed.pipeline_ranks(1)                                     # -> [2, 3, 4]

    layout = PipelineLayout(grid, schedule="1F1B", stages=4, cuts=(3, 6, 9), microbatches=8)
    str(layout)                                                 # "P4xD2 1F1B M=8"
    PipelineLayout.from_dict(layout.to_dict()) == layout        # as recorded in checkpoint manifests

Ranks are laid out with the data-parallel dimension innermost (as torchtitan does):
the replicas of one stage sit on neighbouring ranks, usually one node, so the heavy
gradient all-reduce stays inside a node and only the light activations cross nodes.
Pipelines of mixed depths have no common stage grid: each pipeline takes the next run of ranks
(pipeline 0 the lowest), so its activations stay on neighbouring ranks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Union

from lightning_spot.utils.units import divisors

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

StagesArg = Union[int, Sequence[int], Literal["auto"]]


class LayoutError(ValueError):
    """A requested layout does not fit the world size or the model."""


@dataclass(frozen=True)
class Layout:
    """The process grid: ``pipeline_stages`` (P) x ``data_parallel`` (D) processes, or (``depths`` set)
    one pipeline per entry of ``depths``, of that depth (then P is the deepest and D the pipeline count)."""

    pipeline_stages: int
    data_parallel: int
    depths: tuple[int, ...] = ()

    @classmethod
    def of_depths(cls, depths: Sequence[int]) -> Layout:
        """Pipelines of the given depths; equal depths give the usual P x D grid."""
        depths = tuple(int(d) for d in depths)
        if not depths or any(d < 1 for d in depths):
            raise LayoutError(f"pipeline_stages as a list needs one positive depth per pipeline, got {list(depths)}")
        if len(set(depths)) == 1:
            return cls(depths[0], len(depths))
        return cls(max(depths), len(depths), depths)

    @property
    def is_mixed(self) -> bool:
        """Whether the pipelines have different depths."""
        return bool(self.depths)

    @property
    def pipeline_depths(self) -> tuple[int, ...]:
        """The depth of every pipeline (data-parallel replica)."""
        return self.depths or (self.pipeline_stages,) * self.data_parallel

    @property
    def world_size(self) -> int:
        return sum(self.depths) if self.depths else self.pipeline_stages * self.data_parallel

    def rank_of(self, pipeline: int, stage: int) -> int:
        """The global rank of position ``stage`` in pipeline ``pipeline``."""
        if not self.depths:
            return stage * self.data_parallel + pipeline
        return sum(self.depths[:pipeline]) + stage

    def pipeline_ranks(self, pipeline: int) -> list[int]:
        """The ranks of one pipeline, first stage first."""
        return [self.rank_of(pipeline, s) for s in range(self.pipeline_depths[pipeline])]

    def pp_rank(self, rank: int) -> int:
        """Position of ``rank`` along its pipeline (0 = first stage)."""
        if not self.depths:
            return rank // self.data_parallel
        return rank - sum(self.depths[: self.dp_rank(rank)])

    def dp_rank(self, rank: int) -> int:
        """Index of the data-parallel replica (pipeline) ``rank`` belongs to."""
        if not self.depths:
            return rank % self.data_parallel
        start = 0
        for pipeline, depth in enumerate(self.depths):
            if rank < start + depth:
                return pipeline
            start += depth
        raise LayoutError(f"rank {rank} is outside the layout {self} of {self.world_size} ranks")

    def same_state_key(self, rank: int) -> int:
        """Ranks with equal keys hold the same parameters (the replicas of one stage). Pipelines of mixed depths
        are cut differently, so there every rank counts as holding a state of its own."""
        return rank if self.depths else self.pp_rank(rank)

    def __str__(self) -> str:
        if self.depths:
            return "+".join(f"P{d}" for d in self.depths)
        return f"P{self.pipeline_stages}xD{self.data_parallel}"

    @classmethod
    def for_world(cls, world_size: int, pipeline_stages: StagesArg, *, num_layers: int | None = None) -> Layout:
        """Choose P and D = world_size / P (or the given pipeline depths).

        ``pipeline_stages="auto"`` picks the deepest pipeline that divides the world size and
        has at least one layer per stage. A fixed P that does not divide the world size raises
        :class:`LayoutError` listing the values that would. A list gives one pipeline per entry
        (``[2, 3]`` on 5 ranks); its depths must add up to the world size.
        """
        if world_size < 1:
            raise LayoutError(f"world size must be positive, got {world_size}")
        valid = divisors(world_size)
        if pipeline_stages == "auto":
            fitting = [p for p in valid if num_layers is None or p <= num_layers]
            return cls(fitting[-1], world_size // fitting[-1])
        if isinstance(pipeline_stages, Sequence) and not isinstance(pipeline_stages, str):
            grid = cls.of_depths(pipeline_stages)
            if grid.world_size != world_size:
                raise LayoutError(
                    f"pipeline_stages={list(pipeline_stages)} needs {grid.world_size} processes (one per stage of every "
                    f"pipeline) but the world size is {world_size}. Give depths that add up to {world_size}, "
                    f"e.g. {_example_depths(world_size)}, or pipeline_stages='auto'."
                )
            if num_layers is not None and max(grid.pipeline_depths) > num_layers:
                raise LayoutError(
                    f"a pipeline of depth {max(grid.pipeline_depths)} needs at least that many layers, but the layer "
                    f"sequence has {num_layers}. Use shallower pipelines."
                )
            return grid
        if not isinstance(pipeline_stages, int) or isinstance(pipeline_stages, bool) or pipeline_stages < 1:
            raise LayoutError(
                f"pipeline_stages must be a positive int, a list of depths or 'auto', got {pipeline_stages!r}"
            )
        if world_size % pipeline_stages:
            raise LayoutError(
                f"pipeline_stages={pipeline_stages} does not divide the world size {world_size}: "
                f"world size = pipeline_stages x data-parallel replicas. "
                f"Use one of {valid}, pipelines of mixed depths (e.g. pipeline_stages={_example_depths(world_size, pipeline_stages)}), "
                f"or pipeline_stages='auto'."
            )
        return cls(pipeline_stages, world_size // pipeline_stages)

    def device_mesh(self, device_type: str) -> DeviceMesh:
        """A 2-D ``DeviceMesh`` with dims ``("pp", "dp")``; needs an initialised default group (P x D grids only)."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.depths:
            raise LayoutError(f"pipelines of mixed depths ({self}) have no 2-D device mesh")
        return init_device_mesh(device_type, (self.pipeline_stages, self.data_parallel), mesh_dim_names=("pp", "dp"))


def _example_depths(world_size: int, deepest: int | None = None) -> list[int]:
    """Depths adding up to ``world_size``, each at most ``deepest`` (for error messages)."""
    deepest = max(1, min(deepest or 2, world_size))
    depths = [deepest] * (world_size // deepest)
    if world_size % deepest:
        depths.append(world_size % deepest)
    return depths


@dataclass(frozen=True)
class PipelineLayout:
    """Everything that says how a job is laid out, settled once at setup and passed around as one value.

    ``stages`` is the number of pipeline stages (P x stages per rank for looped schedules), ``cuts``
    the index of the first layer of every stage but the first, ``microbatches`` the micro-batches per
    data-parallel replica and step.

    Pipelines of mixed depths (``grid.is_mixed``) have their own cuts and micro-batch counts,
    ``pipeline_cuts[i]`` and ``pipeline_microbatches[i]``; there ``stages`` is the deepest pipeline's depth,
    ``cuts`` is empty and ``microbatches`` the total over all pipelines. :meth:`cuts_of` and
    :meth:`microbatches_of` answer for any layout.
    """

    grid: Layout
    schedule: str
    stages: int
    cuts: tuple[int, ...]
    microbatches: int
    pipeline_cuts: tuple[tuple[int, ...], ...] = ()
    pipeline_microbatches: tuple[int, ...] = ()

    @classmethod
    def mixed(
        cls, grid: Layout, schedule: str, cuts: Sequence[Sequence[int]], microbatches: Sequence[int]
    ) -> PipelineLayout:
        """Pipelines of mixed depths (one stage per rank), each with its cuts and micro-batches."""
        if len(cuts) != grid.data_parallel or len(microbatches) != grid.data_parallel:
            raise LayoutError(f"{grid} has {grid.data_parallel} pipelines: give cuts and micro-batches for each")
        return cls(
            grid,
            schedule,
            grid.pipeline_stages,
            (),
            sum(microbatches),
            tuple(tuple(int(c) for c in cs) for cs in cuts),
            tuple(int(m) for m in microbatches),
        )

    @property
    def pipeline_stages(self) -> int:
        return self.grid.pipeline_stages

    @property
    def data_parallel(self) -> int:
        return self.grid.data_parallel

    @property
    def world_size(self) -> int:
        return self.grid.world_size

    @property
    def is_mixed(self) -> bool:
        return self.grid.is_mixed

    def cuts_of(self, pipeline: int) -> tuple[int, ...]:
        """The cuts of one pipeline."""
        return self.pipeline_cuts[pipeline] if self.is_mixed else self.cuts

    def microbatches_of(self, pipeline: int) -> int:
        """Micro-batches pipeline ``pipeline`` runs per step."""
        return self.pipeline_microbatches[pipeline] if self.is_mixed else self.microbatches

    @property
    def total_microbatches(self) -> int:
        """Micro-batches per step over all pipelines: the global batch is this many equal micro-batches."""
        return self.microbatches if self.is_mixed else self.microbatches * self.data_parallel

    def _microbatch_label(self) -> str:
        return "+".join(str(m) for m in self.pipeline_microbatches) if self.is_mixed else str(self.microbatches)

    def __str__(self) -> str:
        return f"{self.grid} {self.schedule} M={self._microbatch_label()}"

    def describe(self) -> str:
        """A longer label: the grid, micro-batches, schedule, stages and cuts (chart titles, logs)."""
        if self.is_mixed:
            return (
                f"{self.grid}, {self._microbatch_label()} micro-batches, {self.schedule}, "
                f"cuts {' | '.join(str(list(c)) for c in self.pipeline_cuts)}"
            )
        return (
            f"{self.grid}, {self.microbatches} micro-batches, {self.schedule}, {self.stages} stages, "
            f"cuts {list(self.cuts)}"
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON form recorded in checkpoint manifests, run histories and traces."""
        out: dict[str, Any] = {
            "pipeline_stages": self.pipeline_stages,
            "data_parallel": self.data_parallel,
            "world_size": self.world_size,
            "stages": self.stages,
            "cuts": list(self.cuts),
            "schedule": self.schedule,
            "microbatches": self.microbatches,
        }
        if self.is_mixed:
            out["pipelines"] = [
                {"depth": d, "cuts": list(c), "microbatches": m}
                for d, c, m in zip(self.grid.depths, self.pipeline_cuts, self.pipeline_microbatches)
            ]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PipelineLayout:
        """Read :meth:`to_dict`'s form back; raises :class:`LayoutError` when a field is missing or wrong."""
        try:
            if data.get("pipelines"):
                pipes = list(data["pipelines"])
                layout = cls.mixed(
                    Layout.of_depths([int(p["depth"]) for p in pipes]),
                    str(data["schedule"]),
                    [[int(c) for c in p["cuts"]] for p in pipes],
                    [int(p["microbatches"]) for p in pipes],
                )
            else:
                layout = cls(
                    grid=Layout(int(data["pipeline_stages"]), int(data["data_parallel"])),
                    schedule=str(data["schedule"]),
                    stages=int(data["stages"]),
                    cuts=tuple(int(c) for c in data["cuts"]),
                    microbatches=int(data["microbatches"]),
                )
        except (KeyError, TypeError, ValueError) as err:
            raise LayoutError(f"not a pipeline layout: {dict(data)!r} ({err!r})") from err
        if "world_size" in data and data["world_size"] != layout.world_size:
            raise LayoutError(f"not a pipeline layout: world_size {data['world_size']} != P x D in {dict(data)!r}")
        return layout


def layout_label(data: Mapping[str, Any] | None) -> str:
    """``str(PipelineLayout.from_dict(data))``, or ``"?"`` for a missing or unreadable layout (old records)."""
    if not data:
        return "?"
    try:
        return str(PipelineLayout.from_dict(data))
    except LayoutError:
        return "?"
