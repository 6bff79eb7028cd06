"""Streams (IterableDataset) in global-stream mode: every replica reads the whole stream, keeps its share of each
global batch, and a resume onto any layout continues at the sample after the last trained global batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_spot.data.streams import peek_batch, stream_dataloader
from lightning_spot.layout import LayoutError
from tests.models import StreamDataset

N, BATCH = 40, 8  # 5 global batches per pass


def _loader() -> DataLoader:
    return DataLoader(StreamDataset(N), batch_size=BATCH)


def _global_batches(count: int) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    loader = _loader()
    while len(out) < count:
        out += [x for x, _ in loader]
    return out[:count]


class _Lightning:
    """Reads a replica's loader as Lightning's fit loop does: one batch ahead of the one it trains."""

    def __init__(self, loader: Any, trained: int = 0) -> None:
        self.loader, self.trained = loader, trained  # (a resume restores the count of batches trained)
        self.it = iter(loader)
        self.ahead = next(self.it, None)

    def train(self) -> Any:
        batch, self.ahead = self.ahead, next(self.it, None)
        self.trained += 1
        return batch


def _replica(rank: int, size: int, counter: list[_Lightning]) -> Any:
    return stream_dataloader(_loader(), dp_rank=rank, dp_size=size, divisor=size, progress=lambda: counter[0].trained)


def test_replicas_share_each_global_batch_and_resume_on_another_layout() -> None:
    reference = _global_batches(10)
    box: list[list[_Lightning]] = [[], []]
    replicas = [_replica(r, 2, box[r]) for r in range(2)]
    for r, loader in enumerate(replicas):
        box[r].append(_Lightning(loader))
    for step in range(3):
        shares = [box[r][0].train()[0] for r in range(2)]
        assert torch.equal(torch.cat(shares), reference[step]), "the two shares make up the global batch, in order"
    states = [loader.state_dict() for loader in replicas]
    assert states[0] == states[1] and states[0]["global_batches_done"] == 3
    assert states[0]["stream"] == {"epoch": 0, "position": 3 * BATCH}, "not the position read ahead (4 batches)"

    counter: list[_Lightning] = []
    alone = _replica(0, 1, counter)  # resumed on one replica
    alone.load_state_dict(states[0])
    counter.append(_Lightning(alone, trained=3))
    rest = [counter[0].train()[0] for _ in range(2)]  # batches 3 and 4: the rest of the first pass
    assert all(torch.equal(a, b) for a, b in zip(rest, reference[3:5]))
    assert counter[0].ahead is None, "the pass is over"
    state = alone.state_dict()
    assert state["global_batches_done"] == 5 and state["stream"] == {"epoch": 0, "position": N}

    again: list[_Lightning] = []
    two = _replica(1, 2, again)  # resumed at the end of the pass (Lightning knows: it starts its next epoch)
    two.load_state_dict(state)
    again.append(_Lightning(two, trained=0))
    assert torch.equal(again[0].train()[0], reference[5][BATCH // 2 :]), "the next pass, second half"


def test_a_stream_without_a_position_or_with_workers_is_refused() -> None:
    class Plain(IterableDataset):
        def __iter__(self) -> Any:
            return iter(range(4))

    with pytest.raises(LayoutError, match=r"Plain has no state_dict or load_state_dict.*map-style"):
        stream_dataloader(DataLoader(Plain(), batch_size=2), dp_rank=0, dp_size=1, divisor=None)
    with pytest.raises(LayoutError, match="num_workers=0"):
        stream_dataloader(
            DataLoader(StreamDataset(N), batch_size=BATCH, num_workers=2), dp_rank=0, dp_size=1, divisor=None
        )
    with pytest.raises(LayoutError, match=r"cannot be split evenly into 3 data-parallel replicas"):
        next(iter(stream_dataloader(_loader(), dp_rank=0, dp_size=3, divisor=3)))


def test_lightning_gives_the_epoch_to_a_stream_that_takes_one() -> None:
    """Lightning calls set_epoch on a loader's sampler at each epoch's start: the stream gets it (HF streaming
    datasets reshuffle per epoch that way); a stream without set_epoch is left alone."""
    from lightning.fabric.utilities.data import _set_sampler_epoch

    class Epochs(StreamDataset):
        def set_epoch(self, epoch: int) -> None:
            self.seen = epoch

    loader = stream_dataloader(DataLoader(Epochs(N), batch_size=BATCH), dp_rank=0, dp_size=1, divisor=None)
    _set_sampler_epoch(loader, 3)
    assert loader.dataset.seen == 3
    plain = stream_dataloader(_loader(), dp_rank=0, dp_size=1, divisor=None)
    _set_sampler_epoch(plain, 3)
    assert plain.sampler is None and plain.dataset.state_dict() == {"epoch": 0, "position": 0}


def test_peeking_at_a_stream_leaves_its_position() -> None:
    loader = _loader()
    first = peek_batch(loader)
    assert loader.dataset.state_dict() == {"epoch": 0, "position": 0}  # type: ignore[attr-defined]
    assert torch.equal(first[0], next(iter(loader))[0])
