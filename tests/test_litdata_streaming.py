"""LitData's StreamingDataset in mode "sharded": each data-parallel replica reads its own shard, and a resume onto
another number of replicas or DataLoader workers continues with the same global batches (the first layout's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_spot.data.streams import ShardedStreamLoader, peek_batch, stream_dataloader
from lightning_spot.layout import LayoutError

pytest.importorskip("litdata")

from tests.litdata_data import litdata_loader, sample_ids, write_litdata
from tests.models import TrainedCount

N, BATCH = 96, 12  # 8 global batches per pass; 12 splits into 1, 2, 3 or 4 replicas


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_litdata(tmp_path_factory.mktemp("litdata") / "data", N)


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


@pytest.mark.slow
def test_a_chain_of_resumes_across_layouts_and_workers_trains_like_one_process(tmp_path: Path) -> None:
    """P1xD1 -> P2xD2 -> P2xD1 with 2 DataLoader workers (5 global batches per pass), resumed mid-pass at step 3
    from DCP shards, then at the end of the first pass (step 5) from snapshot files. The final weights equal one
    uninterrupted single-process run over the same LitData stream."""
    from tests.parity import assert_same_params, merged_state, reference_run, run_scenarios

    data = write_litdata(tmp_path / "data", 80)
    common: dict[str, Any] = {"model": {"scheduler": True}, "loader": {"batch_size": 16, "litdata": data}}
    run, memory = str(tmp_path / "run"), str(tmp_path / "shm")

    def phase(name: str, stages: int, steps: int, spot: dict, workers: int = 0) -> dict[str, Any]:
        return {
            **common,
            "loader": {**common["loader"], "num_workers": workers},
            "name": name,
            "strategy": {"pipeline_stages": stages, "microbatches": 2},
            "trainer": {"max_steps": steps},
            "spot_checkpoint": {**spot, "dirpath": run, "every_n_train_steps": 1, "keep_last": 2},
        }

    phases = [
        (1, phase("litdata-1", 1, 3, {"snapshots": False})),
        (4, phase("litdata-2", 2, 5, {"snapshot_dir": memory, "snapshot_every_n_train_steps": 1, "resume": True})),
        (2, phase("litdata-3", 2, 12, {"snapshot_dir": memory, "resume": True}, workers=2)),
    ]
    results: dict[str, list[dict]] = {}
    for i, (world, scenario) in enumerate(phases):
        results.update(run_scenarios(world, [scenario], tmp_path / f"phase{i}", timeout=300))
    assert [(r["restored_step"], r["restored_tier"]) for r in results["litdata-2"]] == [(3, "storage")] * 4
    assert {(r["restored_step"], r["restored_kind"]) for r in results["litdata-3"]} == {(5, "shares")}
    reference = reference_run({**common, "trainer": {"max_steps": 12}})
    assert_same_params(merged_state(results["litdata-3"]), reference)


@pytest.mark.slow
def test_the_survivors_of_a_lost_node_resume_litdata_from_memory(tmp_path: Path) -> None:
    """Two nodes train P2xD2 on LitData's stream with snapshots every 2 steps; one node is SIGKILLed; the
    survivors resume from memory on P2xD1 (D 2 -> 1) and train the global batches of the uninterrupted P2xD2 run."""
    from tests.parity import assert_same_params, merged_state, reference_run
    from tests.test_snapshots import STEPS, _two_nodes_lose_one

    data = write_litdata(tmp_path / "data", 80)
    finals = _two_nodes_lose_one(
        tmp_path, run=str(tmp_path / "run"), loader={"batch_size": 16, "litdata": data, "shuffle": True}
    )
    d2 = Job(data, 2, n=80, batch=16)  # the passes of P2xD2 uninterrupted, each batch in its replicas' row order
    passes = [[i for _ in range(5) for i in d2.step(ordered=True)] for _ in range(-(-STEPS // 5))]
    whole = {"batch_size": 16, "n": 80, "passes": passes}
    reference = reference_run({"model": {"scheduler": True}, "loader": whole, "trainer": {"max_steps": STEPS}})
    assert_same_params(merged_state(finals), reference)
