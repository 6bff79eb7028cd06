"""LitData's StreamingDataset in mode "sharded": each data-parallel replica reads its own shard, and a resume onto
another number of replicas or DataLoader workers continues with the same global batches (the first layout's)."""

from __future__ import annotations

import pytest

from lightning_spot.data.streams import ShardedStreamLoader, peek_batch, stream_dataloader
from lightning_spot.layout import LayoutError
from tests.litdata_data import BATCH, Job, N, litdata_loader, sample_ids, write_litdata

pytest.importorskip("litdata")


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_litdata(tmp_path_factory.mktemp("litdata") / "data", N)


def test_replicas_read_their_shards_and_resume_onto_other_layouts_and_worker_counts(shards: str) -> None:
    """D2 -> D1 -> D3 with 2 workers (across a pass's end) -> D2: the same global batches as D2 uninterrupted."""
    reference = Job(shards, 2).steps(20)
    assert sorted(i for batch in reference[:8] for i in batch) == list(range(N)), "a pass: every sample once"
    assert reference[:8] != reference[8:16], "the second pass is shuffled anew"

    first = Job(shards, 2)
    trained = first.steps(3)
    halves = [sample_ids(share[0], N) for share in first.ahead]
    assert not set(halves[0]) & set(halves[1]), "each replica reads its own shard"
    state = first.state()
    assert state["global_batches_done"] == 3 and state["litdata"]["dataset"]["sample_in_epoch"] == 3 * BATCH

    same = Job(shards, 2, state=state)  # LitData's own resume (the layout that wrote the state)
    assert same.steps(6) == reference[3:9], "across the pass's end"
    assert Job(shards, 2, state=same.state()).steps(2) == reference[9:11]

    one = Job(shards, 1, state=state)
    trained += one.steps(4)
    three = Job(shards, 3, workers=2, state=one.state())
    trained += three.steps(1)  # the pass's last batch
    end = three.state()
    assert end["global_batches_done"] == 0 and end["litdata"]["dataset"]["sample_in_epoch"] == 0, "the next pass"
    trained += three.steps(3)
    two = Job(shards, 2, state=three.state())
    trained += two.steps(9)
    assert trained == reference

    again = Job(shards, 1, state=end)  # from the end of the first pass: the second pass in the first layout's order
    assert again.steps(2) == reference[8:10]
    assert Job(shards, 2, state=end).steps(2) == reference[8:10]


@pytest.mark.slow  # (~20 s: worker processes started for every pass of every replica)
def test_litdata_resumes_on_the_layout_and_workers_that_wrote_the_state_by_its_own_replay(shards: str) -> None:
    """The same D and worker count: LitData's own resume (no canonical list of the pass), mid-pass and at its end."""
    reference = Job(shards, 2, workers=2).steps(10)
    first = Job(shards, 2, workers=2)
    first.steps(3)
    state = first.state()
    assert "resume_mode" not in state["litdata"]["dataset"]
    second = Job(shards, 2, workers=2, state=state)
    assert second.steps(5) == reference[3:8]
    assert Job(shards, 2, workers=2, state=second.state()).steps(2) == reference[8:10]


def test_a_layout_litdata_cannot_share_equally_is_refused(shards: str) -> None:
    with pytest.raises(LayoutError, match="equal share"):
        stream_dataloader(litdata_loader(shards, BATCH), dp_rank=0, dp_size=2, divisor=4, weights=[3, 1])
    with pytest.raises(LayoutError, match="cannot be split evenly into 5"):
        stream_dataloader(litdata_loader(shards, BATCH), dp_rank=0, dp_size=5, divisor=5)
    from litdata import CombinedStreamingDataset, StreamingDataLoader, StreamingDataset

    combined = CombinedStreamingDataset([StreamingDataset(shards), StreamingDataset(shards)])
    with pytest.raises(LayoutError, match="CombinedStreamingDataset is resumed by LitData only on the same layout"):
        stream_dataloader(StreamingDataLoader(combined, batch_size=BATCH), dp_rank=0, dp_size=1, divisor=1)
    loader = stream_dataloader(litdata_loader(shards, BATCH), dp_rank=0, dp_size=2, divisor=2, progress=lambda: 0)
    assert isinstance(loader, ShardedStreamLoader)
    with pytest.raises(LayoutError, match="batch_size=12"):
        loader.load_state_dict({"mode": "sharded", "global_batch_size": 8, "global_batches_done": 1})
    with pytest.raises(LayoutError, match="not a LitData stream"):
        loader.load_state_dict({"mode": "global stream", "global_batch_size": 12})


def test_peeking_reads_a_batch_without_moving_the_stream(shards: str) -> None:
    loader = litdata_loader(shards, BATCH)
    x, _ = peek_batch(loader)
    assert x.shape[0] == BATCH and loader.current_epoch == 0
