"""Which resume mode reads a stream: LitData's ``StreamingDataset`` is sharded, a per-replica stream keeps a fixed
layout, any other stateful stream is global."""

from __future__ import annotations

import copy
from typing import Any

from torch.utils.data import DataLoader

from lightning_spot.data.streams.fixed_layout import FixedLayoutLoader, is_fixed_layout
from lightning_spot.data.streams.global_stream import GlobalStreamLoader
from lightning_spot.data.streams.litdata_shards import ShardedStreamLoader, is_litdata


def stream_dataloader(loader: DataLoader, **share: Any) -> GlobalStreamLoader | ShardedStreamLoader:
    """``loader`` (over an ``IterableDataset``) as this replica's part of each global batch: its own shard for a
    LitData ``StreamingDataset`` (mode "sharded"), the loader's own batches for a per-replica stream (mode "fixed
    layout"), else its share of every global batch of the whole stream (mode "global stream"); ``share``: the
    loaders' keyword arguments (replica index and count, micro-batches, ...)."""
    if is_litdata(loader):
        return ShardedStreamLoader(loader, **share)
    if is_fixed_layout(loader):
        return FixedLayoutLoader(loader, **share)
    return GlobalStreamLoader(loader, **share)


def peek_batch(loader: DataLoader) -> Any:
    """The first batch of ``loader`` without moving a stateful stream (its position is put back)."""
    dataset: Any = loader.dataset
    if is_litdata(loader):  # (its state_dict takes the loader's counts: read samples by index instead)
        return loader.collate_fn([dataset[i] for i in range(min(int(loader.batch_size or 1), len(dataset)))])
    saved = copy.deepcopy(dataset.state_dict()) if callable(getattr(dataset, "state_dict", None)) else None
    try:
        return next(iter(loader))
    finally:
        if saved is not None:
            dataset.load_state_dict(saved)
