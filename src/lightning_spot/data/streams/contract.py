"""What a stream must offer to be resumed exactly, checked at setup with errors that name the fix."""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from lightning_spot.layout import LayoutError


def is_stream(loader: Any) -> bool:
    """Whether ``loader`` is a DataLoader over an ``IterableDataset``."""
    return isinstance(loader, DataLoader) and isinstance(loader.dataset, IterableDataset)


def release_workers(loader: Any) -> None:
    """Shut ``loader``'s DataLoader worker processes down now and drop its iterator, as Lightning does at the end of a
    fit for the loaders it sees (not the one a stream wrapper holds). Left to Python's cycle collector (the wrapper
    is reachable from the trainer's reference cycles), the workers are shut down one after the other, 5 s each,
    their queues being finalised before the iterator: a 10 s stall at some later collection after a fit with two
    workers."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is None:
        return
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if callable(shutdown):
        shutdown()
    loader._iterator = None


def check_stream(loader: DataLoader) -> Any:
    """The object that holds the stream's position (the dataset), or a :class:`LayoutError` saying what is
    missing and how to provide it."""
    dataset = loader.dataset
    name = type(dataset).__name__
    missing = [m for m in ("state_dict", "load_state_dict") if not callable(getattr(dataset, m, None))]
    if missing:
        raise LayoutError(
            f"spot_pipeline resumes a stream exactly, on any layout, from the stream's own position: {name} has no "
            f"{' or '.join(missing)}. Give the dataset state_dict() (its position: samples read, epoch) and "
            f"load_state_dict(state) (iteration then continues there), or use a map-style Dataset."
        )
    if loader.num_workers > 0:
        raise LayoutError(
            f"{name} is read by {loader.num_workers} DataLoader worker processes, where its position lives and "
            f"cannot be saved; use num_workers=0 for a stream (global-stream mode reads it in the training process)."
        )
    if loader.batch_size is None:
        raise LayoutError(
            "spot_pipeline needs a DataLoader with a batch size (batch_size=None is not supported): its batch_size "
            "is the global batch that the layout splits into replicas and micro-batches."
        )
    return dataset
