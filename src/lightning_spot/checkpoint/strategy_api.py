"""What ``SpotCheckpoint`` needs from the training strategy, as a small typed interface.

    if not is_checkpoint_host(trainer.strategy): raise TypeError(...)
    trainer.strategy.use_checkpoint_storage(options, url)  # the callback hands its storage over
    io = trainer.strategy.checkpoints                      # the I/O that trainer.save_checkpoint uses too

``SpotPipelineStrategy`` provides it; the checkpoint package never imports the strategy.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeGuard

import torch

from lightning_spot.checkpoint.memory.snapshot import SnapshotStore
from lightning_spot.checkpoint.pipeline_io import PipelineCheckpointIO
from lightning_spot.checkpoint.replica_rules import CheckpointRules
from lightning_spot.layout import PipelineLayout
from lightning_spot.preemption.step_agreement import StepAgreement
from lightning_spot.runtime.clock import StepClock


class CheckpointHost(Protocol):
    """A strategy that writes and restores pipeline-sharded checkpoints."""

    @property
    def root_device(self) -> torch.device: ...

    @property
    def pipeline_layout(self) -> PipelineLayout:
        """The layout of this run (known once the strategy is set up)."""
        ...

    @property
    def restored_manifest(self) -> dict[str, Any] | None:
        """The manifest of the checkpoint this run resumed from, if any."""
        ...

    @property
    def last_global_batch(self) -> int | None:
        """Samples in the last trained global batch."""
        ...

    @property
    def step_clock(self) -> StepClock | None:
        """This rank's pipeline clock (its ``timeline`` is set while a timeline records)."""
        ...

    @property
    def step_agreement(self) -> StepAgreement:
        """The process's per-step agreement (posted at each batch's start, settled after the optimizer step)."""
        ...

    @property
    def checkpoint_rules(self) -> CheckpointRules:
        """Who writes checkpoints and which tiers this pipeline keeps (``replica_rules``; torchft's in its jobs)."""
        ...

    @property
    def checkpoints(self) -> PipelineCheckpointIO:
        """This rank's checkpoint I/O (a manifest's info, the split into tensors, the write), the one that
        ``trainer.save_checkpoint`` uses too."""
        ...

    def use_checkpoint_storage(
        self, storage_options: dict[str, Any], run_url: str | None = None, snapshots: SnapshotStore | None = None
    ) -> None:
        """Read and write checkpoints with these fsspec options (also ``fit(ckpt_path=URL)``); ``run_url`` is
        the run directory (the strategy keeps its plan there, so that a restart elsewhere finds it);
        ``snapshots`` the in-memory snapshots to resume from (``ckpt_path="snapshot://STEP"``)."""
        ...

    def newest_snapshot(self) -> tuple[int | None, str]:
        """Collective: the newest step whose state the surviving in-memory snapshots hold completely for
        this layout, and why newer ones cannot be used."""
        ...


def is_checkpoint_host(strategy: object) -> TypeGuard[CheckpointHost]:
    """Whether ``strategy`` offers the :class:`CheckpointHost` methods (checked on its class, so that
    properties that need a set-up strategy are not evaluated)."""
    cls = type(strategy)
    return all(callable(getattr(cls, name, None)) for name in ("use_checkpoint_storage",)) and all(
        hasattr(cls, name) for name in ("checkpoints", "pipeline_layout", "last_global_batch", "step_clock")
    )
