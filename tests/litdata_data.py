"""LitData datasets for the tests: :func:`tests.models.make_dataset`'s samples written as LitData chunks (in
process, with LitData's own writer) and read back by a ``StreamingDataLoader``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_spot.data.streams import stream_dataloader
from tests.models import TrainedCount, make_dataset


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


#: the shards' samples and the global batch of the litdata tests (12 splits into 1, 2, 3 or 4 replicas)
N, BATCH = 96, 12


class Job:
    """D replicas read as Lightning's fit loop reads: one batch ahead of the one trained, the count of batches
    trained in the pass starting again at 0 when a pass ends (Lightning knows the pass's length)."""

    def __init__(
        self, shards: str, replicas: int, workers: int = 0, state: dict | None = None, n: int = N, batch: int = BATCH
    ) -> None:
        self.n = n
        self.count = TrainedCount(int(state["global_batches_done"]) if state else 0)
        self.loaders = [
            stream_dataloader(
                litdata_loader(shards, batch, num_workers=workers),
                dp_rank=r,
                dp_size=replicas,
                divisor=replicas,
                progress=self.count,
            )
            for r in range(replicas)
        ]
        for loader in self.loaders:
            if state:
                loader.load_state_dict(state)
        self._begin()

    def _begin(self) -> None:
        self.its = [iter(loader) for loader in self.loaders]
        self.ahead = [next(it, None) for it in self.its]

    def step(self, ordered: bool = False) -> list[int]:
        if self.ahead[0] is None:  # Lightning's next epoch
            self.count.value = 0
            self._begin()
        batch = torch.cat([share[0] for share in self.ahead])
        self.ahead = [next(it, None) for it in self.its]
        self.count.value += 1
        return sample_ids(batch, self.n, ordered)

    def steps(self, count: int) -> list[list[int]]:
        return [self.step() for _ in range(count)]

    def state(self) -> dict[str, Any]:
        states = [loader.state_dict() for loader in self.loaders]
        assert all(s["global_batches_done"] == states[0]["global_batches_done"] for s in states)
        return states[0]
