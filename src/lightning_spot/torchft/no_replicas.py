"""The pipeline's replica group when torchft is off: a null object whose every call passes through.

    replicas = NoReplicas()                       # or a ReplicaGroup (fault_tolerance="torchft")
    batch, size = replicas.begin_step(batch, m, step)   # the whole global batch, its size not known here
    factor = replicas.batch_done(weight)                # 1: the gradients enter .grad as they are
    closure = replicas.committed(closure, weight, keep) # the closure itself: every step counts

The strategy calls the same methods either way, so it has no torchft branches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, Protocol


class Replicas(Protocol):
    """What the strategy asks of this pipeline's replica group (``ReplicaGroup`` or :class:`NoReplicas`)."""

    @property
    def participant_rank(self) -> int: ...

    def begin_step(
        self, batch: Any, microbatches: int, global_step: int, again: Optional[Callable[[], None]] = None
    ) -> tuple[Any, Optional[int]]: ...

    def batch_done(self, weight: float) -> float: ...

    def committed(
        self, closure: Callable[[], Any], weight: Callable[[], float], keep: Callable[[], Callable[[], None]]
    ) -> Callable[[], Any]: ...

    def take_events(self) -> list[dict[str, Any]]: ...

    def shutdown(self) -> None: ...


class NoReplicas:
    """One pipeline alone in its world (or replicated by DDP inside it): nothing to agree with other pipelines."""

    participant_rank = 0

    def begin_step(
        self, batch: Any, microbatches: int, global_step: int, again: Optional[Callable[[], None]] = None
    ) -> tuple[Any, Optional[int]]:
        return batch, None

    def batch_done(self, weight: float) -> float:
        return 1.0

    def committed(
        self, closure: Callable[[], Any], weight: Callable[[], float], keep: Callable[[], Callable[[], None]]
    ) -> Callable[[], Any]:
        return closure

    def take_events(self) -> list[dict[str, Any]]:
        return []

    def shutdown(self) -> None:
        pass
