"""The pipeline-depth x data-parallel layout of a job, and its process groups.

    layout = Layout.for_world(world_size=8, pipeline_stages=4)   # P=4, D=2
    mesh = layout.device_mesh("cuda")                             # dims ("pp", "dp")
    layout.pp_rank(5), layout.dp_rank(5)                          # -> (2, 1)

Ranks are laid out with the data-parallel dimension innermost (as torchtitan does):
the replicas of one stage sit on neighbouring ranks, usually one node, so the heavy
gradient all-reduce stays inside a node and only the light activations cross nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Union

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

StagesArg = Union[int, Literal["auto"]]


class LayoutError(ValueError):
    """A requested layout does not fit the world size or the model."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Layout:
    """``pipeline_stages`` (P) x ``data_parallel`` (D) processes."""

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
        valid = _divisors(world_size)
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

        return init_device_mesh(
            device_type, (self.pipeline_stages, self.data_parallel), mesh_dim_names=("pp", "dp")
        )
