"""What the observability callbacks read from the strategy, as a small typed interface.

host = pipeline_host(trainer.strategy)     # None under strategies other than spot_pipeline
if host is not None:
    host.step_clock.timeline = timeline     # trace this rank's pipeline
    host.pipeline_stats()                   # layout and bubble of the last step
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

from lightning_spot.layout import PipelineLayout
from lightning_spot.runtime.clock import StepClock


class PipelineHost(Protocol):
    """A strategy that runs a pipeline (``SpotPipelineStrategy``)."""

    #: time DDP's gradient all-reduce in timelines (read when the strategy is set up)
    trace_allreduce: bool

    @property
    def step_clock(self) -> Optional[StepClock]:
        """This rank's pipeline clock; ``None`` before setup."""
        ...

    @property
    def pipeline_layout(self) -> PipelineLayout:
        """The layout of this run (known once the strategy is set up)."""
        ...

    def pipeline_stats(self) -> dict[str, Any]:
        """Layout and bubble of the last training step on this rank (empty before the first one)."""
        ...

    @property
    def last_global_batch(self) -> Optional[int]:
        """Samples in the last trained global batch (``None`` before the first step)."""
        ...

    def count_parameters(self) -> int:
        """Parameters of the whole model, over all pipeline stages (collective)."""
        ...


_MEMBERS = ("step_clock", "pipeline_layout", "pipeline_stats", "count_parameters", "last_global_batch")


def pipeline_host(strategy: object) -> Optional[PipelineHost]:
    """``strategy`` as a :class:`PipelineHost`, or ``None`` if it does not run a pipeline (checked on its
    class, so that properties that need a set-up strategy are not evaluated)."""
    cls = type(strategy)
    if all(hasattr(cls, name) for name in _MEMBERS) and hasattr(strategy, "trace_allreduce"):
        return strategy  # type: ignore[return-value]
    return None
