"""torchft's checkpoint rules, handed to ``SpotCheckpoint`` by the strategy (``checkpoint.replica_rules``).

    rules = ReplicatedCheckpoints("s2c2_pipeline_1", lambda: strategy.replicas_now)

A joiner heals from the live pipelines of the quorum; when every pipeline starts again (a full restart), each
resumes from its own newest state, its snapshots in host memory (kept apart from the other pipelines' on a node, by
replica group) or the durable checkpoints, and the pipelines that resumed an older step than another take its state
at their first step (``ReplicaGroup.begin_step``). The first pipeline of the quorum writes the durable checkpoints
(the same state on every pipeline); each pipeline keeps its own run history (its restarts, the quorums it saw), fed
by its replica group's events.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_spot.torchft.no_replicas import Replicas


@dataclass(frozen=True)
class ReplicatedCheckpoints:
    """This pipeline's checkpoint rules in a torchft job (``replicas``: its replica group, attached at fit start)."""

    history_id: str
    replicas: Callable[[], Replicas]
    keeps_snapshots: bool = True

    def writes(self) -> bool:
        return self.replicas().participant_rank == 0

    def events(self) -> list[dict[str, Any]]:
        return self.replicas().take_events()
