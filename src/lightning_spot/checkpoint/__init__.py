"""Sharded, layout-independent checkpoints on any fsspec URL (``SpotCheckpoint``) and tools to read them."""

from lightning_spot.checkpoint.callback import SpotCheckpoint
from lightning_spot.checkpoint.durable.read import CheckpointError
from lightning_spot.checkpoint.durable.storage import StorageError

__all__ = ["CheckpointError", "SpotCheckpoint", "StorageError"]
