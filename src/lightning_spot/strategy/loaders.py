"""The training data as each rank reads it: its replica's share of every global batch, on any layout.

    loader = loader_for(dataloader, engine, trainer, fed=True, streams=made)   # sharded, or a stream, positioned
    class SpotPipelineStrategy(..., DataHooks, ...): ...   # Lightning's data hooks, calling loader_for

A map-style loader's batches are split among the data-parallel replicas (each loads its share; resumable by the
global batches trained this epoch, the same count on every layout). A stream is read by the first stage of each
pipeline and sent to the others (``fed``; every stage reads it under torchft or with pipelines of mixed depths).
"""

from __future__ import annotations

import gc
import os
import weakref
from collections.abc import Callable
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies.parallel import ParallelStrategy
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_spot.data.sharded import shard_dataloader
from lightning_spot.data.streams import is_stream, stage_feed, stream_dataloader
from lightning_spot.runtime.engine import PipelineEngine
from lightning_spot.strategy.settings import PipelineSettings
from lightning_spot.utils.distributed import is_initialized


def loader_for(
    dataloader: object,
    engine: PipelineEngine,
    trainer: Optional[pl.Trainer],
    fed: bool,
    streams: weakref.WeakSet[Any],
) -> object:
    """What this rank reads of ``dataloader`` (see the module's text); other objects are returned as they are. The
    stream loaders made are added to ``streams`` (their workers are shut down at teardown: Lightning does so only
    for the loaders it sees)."""
    if not isinstance(dataloader, DataLoader):
        return dataloader
    free_garbage_before_workers_fork(dataloader)
    epoch_loop = trainer.fit_loop.epoch_loop if trainer is not None and trainer.training else None
    layout = engine.layout
    share: dict[str, Any] = {  # progress: global batches trained this epoch (the same on every layout)
        "dp_rank": engine.ctx.dp_rank,
        "dp_size": layout.grid.data_parallel,
        "weights": layout.pipeline_microbatches if layout.is_mixed else None,
        "divisor": layout.total_microbatches if epoch_loop is not None else None,
        "progress": (lambda: epoch_loop.batch_progress.current.processed) if epoch_loop else None,  # type: ignore[attr-defined]
        "world_size": layout.grid.world_size,
    }
    if is_stream(dataloader):  # read on the first stage only (every stage under torchft or mixed depths)
        ctx, fed = engine.ctx, fed and not layout.is_mixed
        stream = stage_feed(stream_dataloader(dataloader, **share), ctx.pp_group if fed else None, ctx.pp_rank == 0)
        streams.add(stream)
        return stream
    return shard_dataloader(dataloader, seed=int(os.environ.get("PL_GLOBAL_SEED", 0)), **share)


def free_garbage_before_workers_fork(dataloader: DataLoader) -> None:
    """Free the garbage of earlier fits in this process (process groups in reference cycles, of a dropped Trainer)
    before ``dataloader`` forks its workers: freed inside a forked worker, a gloo group's destructor waits for threads
    that were not forked, and the worker hangs. (Only for loaders with workers: a collection costs ~0.2 s with torch
    and Lightning loaded.)"""
    if dataloader.num_workers > 0 and is_initialized():
        gc.collect()


class DataHooks(ParallelStrategy):
    """Lightning's data hooks of the strategy (a mixin of ``SpotPipelineStrategy``, which sets what is declared
    here): the transfer hooks' draws seeded alike on every stage, and each loader made this rank's share."""

    settings: PipelineSettings
    _streams: weakref.WeakSet[Any]
    _engine: Callable[[], PipelineEngine]  # (the engine, once built: CheckpointHooks._engine)

    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        self._engine().runner.seed_hooks()  # (the transfer hooks' augmentations draw alike on every stage)
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        self._engine().runner.seed_hooks()  # (and the first batch's on_before_batch_transfer)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        fed = self.settings.fault_tolerance is None
        return loader_for(dataloader, self._engine(), trainer, fed=fed, streams=self._streams)
