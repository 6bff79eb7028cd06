"""Checkpoints of a pipeline, read and written on any layout: the one I/O of both save paths.

    io = strategy.checkpoints                          # PipelineCheckpointIO(engine, sources), once set up
    io.info(checkpoint)                                # step, layout, data position: the manifest's
    io.save(checkpoint, url, options, whole=rank == 0) # trainer.save_checkpoint (ModelCheckpoint): a directory
    payload = io.split(checkpoint, whole=..., copy=True, staging=staging)   # SpotCheckpoint's saves: the copy,
    io.write(storage, "step-000000200", payload, info, group=gloo)          # then the upload (in a thread)
    checkpoint, manifest = io.load(url, module, optimizers, offload)   # storage, snapshot or run directory

Each rank writes and reads only its stages' tensors, by parameter name, so a checkpoint written on one layout
loads onto any other; optimizer state is keyed by parameter name (flattened) for the same reason.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any, Optional

import lightning.pytorch as pl
from torch import nn

from lightning_spot.checkpoint import flat_optimizer, payload
from lightning_spot.checkpoint.durable import pretrained_record, write
from lightning_spot.checkpoint.durable.storage import Storage
from lightning_spot.checkpoint.sources import StateSources
from lightning_spot.checkpoint.staging import Staging
from lightning_spot.runtime.engine import PipelineEngine
from lightning_spot.runtime.offload import OptimizerOffload


class PipelineCheckpointIO:
    """This rank's checkpoint reads and writes (see the module's text)."""

    def __init__(self, engine: PipelineEngine, sources: StateSources) -> None:
        self.engine = engine
        self.sources = sources

    @property
    def aliases(self) -> dict[str, str]:
        """This rank's other names of tied parameters -> the name checkpoints store them under."""
        return self.engine.ties.aliases

    def info(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """Step, layout and data position for a checkpoint manifest."""
        engine = self.engine
        return {
            "step": int(checkpoint.get("global_step", 0)),
            "epoch": int(checkpoint.get("epoch", 0)),
            "layout": engine.layout.to_dict(),
            "data": {"global_batch": engine.last_global_batch, "samples_consumed": engine.samples_seen},
            "tied": dict(engine.ties.aliases),
            "pretrained": pretrained_record.describe(engine.module),
        }

    def optimizer_state(self, module: nn.Module, optimizer: Any) -> dict[str, Any]:
        """The optimizer state keyed by parameter name (flattened), so that any layout can read it."""
        return payload.stored_names(flat_optimizer.optimizer_state(module, optimizer), self.aliases)

    def split(
        self, checkpoint: dict[str, Any], *, whole: bool, copy: bool = False, staging: Optional[Staging] = None
    ) -> payload.Payload:
        """This rank's part of ``checkpoint`` as tensors and JSON, under the stored names (``whole``: with
        Lightning's own entries, on one rank; ``copy``: the tensors copied to host memory, into ``staging``)."""
        return payload.split_checkpoint(
            checkpoint, copy=copy, with_lightning=whole, staging=staging, aliases=self.aliases
        )

    def write(
        self, storage: Storage, rel: str, parts: payload.Payload, info: dict[str, Any], **options: Any
    ) -> Optional[dict[str, Any]]:
        """Collective: write every rank's ``parts`` under ``rel`` and commit them with the manifest (returned on
        the first rank); ``options``: ``write_checkpoint``'s (the group, threads, snapshot files to upload)."""
        return write.write_checkpoint(storage, rel, parts, info=info, **options)

    def save(self, checkpoint: dict[str, Any], url: str, options: Optional[Any], whole: bool) -> None:
        """Write this rank's part of a sharded checkpoint directory at ``url`` (``whole``: with Lightning's own
        entries, on one rank); the caller waits for every rank."""
        options = options if options is not None else self.sources.storage_options
        self.write(Storage(url, options), "", self.split(checkpoint, whole=whole), self.info(checkpoint))

    def load(
        self, url: str, module: pl.LightningModule, optimizers: list[Any], offload: Optional[OptimizerOffload]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(Lightning checkpoint, manifest with the tier read and the time it took) of a checkpoint written on any
        layout, read onto this one: weights and optimizer state straight into the host masters with offload."""
        started = time.monotonic()
        with offload.on_host(optimizers) if offload is not None else nullcontext():
            checkpoint, record, tier = self.sources.load(
                url, module, optimizers, layout=self.engine.layout, aliases=self.aliases
            )
        self.engine.restore_position(int(record.get("data", {}).get("samples_consumed") or 0))
        return checkpoint, {**record, "tier": tier, "restore_seconds": time.monotonic() - started}
