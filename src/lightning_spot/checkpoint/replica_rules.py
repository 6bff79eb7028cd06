"""Who writes a pipeline's checkpoints and which tiers it keeps: a rule object the strategy hands to ``SpotCheckpoint``.

    rules = trainer.strategy.checkpoint_rules   # OwnCheckpoints(), or torchft's ``ReplicatedCheckpoints``
    rules.keeps_snapshots                       # False where other pipelines hold this one's state
    rules.history_id                            # this pipeline's own run history (None: the run's)
    if rules.writes(): ...                      # this step's durable checkpoint is this pipeline's to write
    for event in rules.events(): ...            # quorum changes, steps run again: for the run history

``SpotCheckpoint`` asks these questions and has no torchft branches; the answers of a pipeline alone in its world
(replicated by DDP inside it, if at all) are :class:`OwnCheckpoints`'.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol


class CheckpointRules(Protocol):
    """The checkpoint rules of this pipeline among the pipelines that replicate it."""

    @property
    def keeps_snapshots(self) -> bool: ...

    @property
    def history_id(self) -> Optional[str]: ...

    def writes(self) -> bool: ...

    def events(self) -> list[dict[str, Any]]: ...


class OwnCheckpoints:
    """A pipeline alone in its world: it writes every checkpoint, keeps snapshots, records in the run's history."""

    keeps_snapshots = True
    history_id: Optional[str] = None

    def writes(self) -> bool:
        return True

    def events(self) -> list[dict[str, Any]]:
        return []
