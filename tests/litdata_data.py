"""LitData datasets for the tests: :func:`tests.models.make_dataset`'s samples written as LitData chunks (in
process, with LitData's own writer) and read back by a ``StreamingDataLoader``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.models import make_dataset


def write_litdata(directory: str | Path, n: int, chunk_size: int = 8) -> str:
    """``make_dataset(n)``'s samples, ``(x, y)`` each, as LitData chunks of ``chunk_size`` in ``directory``."""
    from litdata.streaming.writer import BinaryWriter

    Path(directory).mkdir(parents=True, exist_ok=True)
    if (Path(directory) / "index.json").exists():
        return str(directory)
    writer = BinaryWriter(str(directory), chunk_size=chunk_size)
    for i, (x, y) in enumerate(make_dataset(n)):
        writer[i] = (x, y)
    writer.done()
    writer.merge()
    return str(directory)


def litdata_loader(directory: str, batch_size: int, shuffle: bool = True, num_workers: int = 0) -> Any:
    """A ``StreamingDataLoader`` over the LitData dataset in ``directory`` (shuffled with a fixed seed)."""
    from litdata import StreamingDataLoader, StreamingDataset

    dataset = StreamingDataset(directory, shuffle=shuffle, drop_last=True, seed=7)
    return StreamingDataLoader(dataset, batch_size=batch_size, num_workers=num_workers)


def sample_ids(xs: torch.Tensor, n: int, ordered: bool = False) -> list[int]:
    """The indices in ``make_dataset(n)`` of the samples whose inputs are the rows of ``xs``: sorted, or in the
    rows' order (``ordered``)."""
    inputs = make_dataset(n).tensors[0]
    ids = [int((inputs == row).all(dim=1).nonzero()[0]) for row in xs]
    return ids if ordered else sorted(ids)
