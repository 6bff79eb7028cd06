"""The layout of a job: its process grid (P x D) and, once set up, the whole :class:`PipelineLayout`.

    grid = Layout.for_world(world_size=8, pipeline_stages=4)   # P=4, D=2
    mesh = grid.device_mesh("cuda")                             # dims ("pp", "dp")
    grid.pp_rank(5), grid.dp_rank(5)                            # -> (2, 1)

    layout = PipelineLayout(grid, schedule="1F1B", stages=4, cuts=(3, 6, 9), microbatches=8)
    str(layout)                                                 # "P4xD2 1F1B M=8"
    PipelineLayout.from_dict(layout.to_dict()) == layout        # as recorded in checkpoint manifests

Ranks are laid out with the data-parallel dimension innermost (as torchtitan does):
the replicas of one stage sit on neighbouring ranks, usually one node, so the heavy
gradient all-reduce stays inside a node and only the light activations cross nodes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Union

from lightning_spot._units import divisors

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

StagesArg = Union[int, Literal["auto"]]


class LayoutError(ValueError):
    """A requested layout does not fit the world size or the model."""


@dataclass(frozen=True)
class Layout:
    """The process grid: ``pipeline_stages`` (P) x ``data_parallel`` (D) processes."""

    pipeline_stages: int
    data_parallel: int

    @property
    def world_size(self) -> int:
        return self.pipeline_stages * self.data_parallel

    def pp_rank(self, rank: int) -> int:
        """Position of ``rank`` along the pipeline (0 = first stage group)."""
        return rank // self.data_parallel

    def dp_rank(self, rank: int) -> int:
        """Index of the data-parallel replica ``rank`` belongs to."""
        return rank % self.data_parallel

    def __str__(self) -> str:
        return f"P{self.pipeline_stages}xD{self.data_parallel}"

    @classmethod
    def for_world(cls, world_size: int, pipeline_stages: StagesArg, *, num_layers: int | None = None) -> Layout:
        """Choose P and D = world_size / P.

        ``pipeline_stages="auto"`` picks the deepest pipeline that divides the world size and
        has at least one layer per stage. A fixed P that does not divide the world size raises
        :class:`LayoutError` listing the values that would.
        """
        if world_size < 1:
            raise LayoutError(f"world size must be positive, got {world_size}")
        valid = divisors(world_size)
        if pipeline_stages == "auto":
            fitting = [p for p in valid if num_layers is None or p <= num_layers]
            return cls(fitting[-1], world_size // fitting[-1])
        if not isinstance(pipeline_stages, int) or isinstance(pipeline_stages, bool) or pipeline_stages < 1:
            raise LayoutError(f"pipeline_stages must be a positive int or 'auto', got {pipeline_stages!r}")
        if world_size % pipeline_stages:
            raise LayoutError(
                f"pipeline_stages={pipeline_stages} does not divide the world size {world_size}: "
                f"world size = pipeline_stages x data-parallel replicas. "
                f"Use one of {valid}, or pipeline_stages='auto'."
            )
        return cls(pipeline_stages, world_size // pipeline_stages)

    def device_mesh(self, device_type: str) -> DeviceMesh:
        """A 2-D ``DeviceMesh`` with dims ``("pp", "dp")``; needs an initialised default group."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.pipeline_stages, self.data_parallel), mesh_dim_names=("pp", "dp"))


@dataclass(frozen=True)
class PipelineLayout:
    """Everything that says how a job is laid out, settled once at setup and passed around as one value.

    ``stages`` is the number of pipeline stages (P x stages per rank for looped schedules), ``cuts``
    the index of the first layer of every stage but the first, ``microbatches`` the micro-batches per
    data-parallel replica and step.
    """

    grid: Layout
    schedule: str
    stages: int
    cuts: tuple[int, ...]
    microbatches: int

    @property
    def pipeline_stages(self) -> int:
        return self.grid.pipeline_stages

    @property
    def data_parallel(self) -> int:
        return self.grid.data_parallel

    @property
    def world_size(self) -> int:
        return self.grid.world_size

    def __str__(self) -> str:
        return f"{self.grid} {self.schedule} M={self.microbatches}"

    def describe(self) -> str:
        """A longer label: the grid, micro-batches, schedule, stages and cuts (chart titles, logs)."""
        return (
            f"{self.grid}, {self.microbatches} micro-batches, {self.schedule}, {self.stages} stages, "
            f"cuts {list(self.cuts)}"
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON form recorded in checkpoint manifests, run histories and traces."""
        return {
            "pipeline_stages": self.pipeline_stages,
            "data_parallel": self.data_parallel,
            "world_size": self.world_size,
            "stages": self.stages,
            "cuts": list(self.cuts),
            "schedule": self.schedule,
            "microbatches": self.microbatches,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PipelineLayout:
        """Read :meth:`to_dict`'s form back; raises :class:`LayoutError` when a field is missing or wrong."""
        try:
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
