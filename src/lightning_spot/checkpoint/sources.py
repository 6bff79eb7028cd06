"""Where a run's state is read from on resume: checkpoint URLs (with their fsspec options), the run directory, and
the in-memory snapshots, read onto the model and optimizers of this layout.

    sources = StateSources()
    sources.use(storage_options, run_url, snapshots)           # SpotCheckpoint hands these over
    step, why = sources.newest_snapshot(module, optimizers, aliases)   # collective
    checkpoint, manifest, tier = sources.load(url, module, optimizers, layout=layout, aliases=aliases)

``url`` is a checkpoint (or run) directory on any fsspec URL, or ``snapshot://STEP``.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule

from lightning_spot.checkpoint.durable.read import CheckpointError, load_checkpoint, load_snapshot, snapshot_needs
from lightning_spot.checkpoint.memory.recall import Recall
from lightning_spot.checkpoint.memory.snapshot import SNAPSHOT_SCHEME, SnapshotStore
from lightning_spot.layout import PipelineLayout


class StateSources:
    """The storage options, run directory and snapshots of a run, and reading a checkpoint from them."""

    def __init__(self) -> None:
        self.storage_options: dict[str, Any] = {}
        self.run_url: str | None = None
        self.snapshots: SnapshotStore | None = None
        self._recalled: Recall | None = None  # what every node's snapshots hold, gathered for one resume

    def use(
        self, storage_options: dict[str, Any], run_url: str | None = None, snapshots: SnapshotStore | None = None
    ) -> None:
        self.storage_options = dict(storage_options)
        self.run_url = run_url
        self.snapshots = snapshots

    def newest_snapshot(
        self, module: LightningModule, optimizers: list[torch.optim.Optimizer], aliases: dict[str, str]
    ) -> tuple[int | None, str]:
        """Collective: the newest step the surviving in-memory snapshots hold completely for this layout, and why
        newer ones cannot be used."""
        self._recalled = None
        return self._recall(module, optimizers, aliases).newest_complete()

    def _recall(
        self, module: LightningModule, optimizers: list[torch.optim.Optimizer], aliases: dict[str, str]
    ) -> Recall:
        if self.snapshots is None:
            raise CheckpointError(
                "no in-memory snapshots to resume from: SpotCheckpoint(snapshot_every_n_train_steps=N)"
            )
        if self._recalled is None:
            needs = snapshot_needs(module, optimizers, aliases)
            self._recalled = Recall.gather(self.snapshots, needs, self.snapshots.group)
        return self._recalled

    def load(
        self,
        url: str,
        module: LightningModule,
        optimizers: list[torch.optim.Optimizer],
        *,
        layout: PipelineLayout,
        aliases: dict[str, str],
    ) -> tuple[dict[str, Any], dict[str, Any], str]:
        """Read ``url`` onto the module and optimizers: Lightning's checkpoint dict, the manifest, and the tier
        (``"memory"`` or ``"storage"``)."""
        if url.startswith(SNAPSHOT_SCHEME):
            recall = self._recall(module, optimizers, aliases)
            self._recalled = None  # gathered for this resume only
            step = int(url[len(SNAPSHOT_SCHEME) :])
            checkpoint, record = load_snapshot(recall, step, module, optimizers, layout=layout, aliases=aliases)
            return checkpoint, record, "memory"
        checkpoint, record = load_checkpoint(
            url, self.storage_options, module, optimizers, layout=layout, aliases=aliases
        )
        return checkpoint, record, "storage"
