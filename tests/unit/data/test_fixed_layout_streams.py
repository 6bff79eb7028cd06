"""Per-replica streams (mode "fixed layout"): each replica's loader yields its own local batches and keeps its own
position; checkpoints keep every replica's; a resume needs the same D and worker count, or says which mode allows
a change."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_spot.data.streams import FixedLayoutLoader, fixed_layout, is_fixed_layout, stream_dataloader
from lightning_spot.data.streams.fixed_layout import merge_replica_states, replica_states
from lightning_spot.layout import LayoutError
from tests.models import ReplicaStream, StreamDataset, TrainedCount

N, BATCH = 40, 8  # 5 global batches per pass


def _global_batches(count: int) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    loader = DataLoader(StreamDataset(N), batch_size=BATCH)
    while len(out) < count:
        out += [x for x, _ in loader]
    return out[:count]


class Replicas:
    """D replicas' per-replica loaders, read as Lightning reads: one batch ahead, a new pass after StopIteration."""

    def __init__(self, d: int, workers: int = 0, state: dict | None = None, stateful: bool = False) -> None:
        self.count = TrainedCount(int(state["global_batches_done"]) if state and "global_batches_done" in state else 0)
        if state and "replicas" in state:
            self.count.value = int(next(iter(state["replicas"].values()))["global_batches_done"])
        self.loaders = [self._loader(r, d, workers, stateful) for r in range(d)]
        for loader in self.loaders:
            loader.load_state_dict(state or {})
        self._begin()

    def _loader(self, r: int, d: int, workers: int, stateful: bool) -> Any:
        stream = ReplicaStream(N, True, BATCH, r, d)
        if stateful:
            from torchdata.stateful_dataloader import StatefulDataLoader

            plain: DataLoader = StatefulDataLoader(stream, batch_size=BATCH // d, num_workers=workers)
        else:
            plain = fixed_layout(DataLoader(stream, batch_size=BATCH // d, num_workers=workers))
        return stream_dataloader(plain, dp_rank=r, dp_size=d, divisor=d, progress=self.count)

    def _begin(self) -> None:
        self.its = [iter(loader) for loader in self.loaders]
        self.ahead = [next(it, None) for it in self.its]

    def step(self) -> torch.Tensor:
        if self.ahead[0] is None:
            self.count.value = 0
            self._begin()
        batch = torch.cat([share[0] for share in self.ahead])
        self.ahead = [next(it, None) for it in self.its]
        self.count.value += 1
        return batch

    def steps(self, count: int) -> list[torch.Tensor]:
        return [self.step() for _ in range(count)]

    def merged(self) -> dict[str, Any]:
        """The state a durable checkpoint keeps: every replica's, gathered by the first rank."""
        per_rank = [_lightning(loader.state_dict()) for loader in self.loaders]
        manifest = _lightning(per_rank[0]["loops"]["fit_loop"]["state_dict"]["combined_loader"][0])
        merge_replica_states(manifest, [replica_states(p) for p in per_rank])
        return manifest["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]


def _lightning(loader_state: dict) -> dict[str, Any]:
    return {"loops": {"fit_loop": {"state_dict": {"combined_loader": [loader_state]}}}}


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_replicas_resume_their_own_streams_from_a_merged_or_own_state() -> None:
    reference = _global_batches(12)
    job = Replicas(2)
    assert _same(job.steps(3), reference[:3]), "the replicas' local batches make up the global batches"
    state = job.merged()
    assert set(state["replicas"]) == {"0", "1"} and state["data_parallel"] == 2
    assert state["replicas"]["1"]["stream"] == {"epoch": 0, "position": 3 * BATCH // 2}, "not read ahead"
    again = Replicas(2, state=state)  # (P may change: only D and the workers matter)
    assert _same(again.steps(4), reference[3:7]), "across the pass's end"
    own = Replicas(2)
    own.loaders[0].load_state_dict(again.loaders[0].state_dict())  # a snapshot: each rank its own
    own.loaders[1].load_state_dict(again.loaders[1].state_dict())
    own.count.value = 2
    own._begin()
    assert _same(own.steps(2), reference[7:9])


def test_a_resume_at_a_pass_end_begins_the_next_pass() -> None:
    """A checkpoint after a pass's last batch (5 global batches per pass), resumed twice in a row."""
    reference = _global_batches(15)
    job = Replicas(2)
    assert _same(job.steps(5), reference[:5])
    end = job.merged()
    assert end["replicas"]["0"]["global_batches_done"] == 5
    second = Replicas(2, state=end)  # (Lightning's count goes on: a stream without len ends its epoch when it stops)
    assert _same(second.steps(5), reference[5:10]), "the next pass, in its own order"
    third = Replicas(2, state=second.merged())
    assert _same(third.steps(5), reference[10:15])


def test_a_resume_onto_another_width_or_worker_count_names_the_modes_that_allow_it() -> None:
    job = Replicas(2)
    job.steps(2)
    state = job.merged()
    with pytest.raises(
        LayoutError, match=r"2 data-parallel replicas with num_workers=0; this run has 1.*global stream"
    ):
        Replicas(1, state=state)
    with pytest.raises(LayoutError, match=r"num_workers=2.*sharded"):
        Replicas(2, workers=2, state=state, stateful=True)
    wrong = stream_dataloader(
        fixed_layout(DataLoader(ReplicaStream(N, True, BATCH, 0, 2), batch_size=BATCH // 2)),
        dp_rank=0,
        dp_size=2,
        divisor=2,
    )
    with pytest.raises(LayoutError, match="no position of replica 0"):
        wrong.load_state_dict({**state, "replicas": {"1": state["replicas"]["1"]}})
    with pytest.raises(LayoutError, match="mixed"):
        stream_dataloader(
            fixed_layout(DataLoader(StreamDataset(N), batch_size=4)), dp_rank=0, dp_size=2, divisor=4, weights=[3, 1]
        )


def test_a_stateful_dataloader_with_workers_resumes_exactly() -> None:
    """torchdata's StatefulDataLoader is recognised as a per-replica stream; its state holds its workers'."""
    pytest.importorskip("torchdata")
    reference = _global_batches(5)
    job = Replicas(2, workers=2, stateful=True)
    assert isinstance(job.loaders[0], FixedLayoutLoader) and is_fixed_layout(job.loaders[0].loader)
    assert _same(job.steps(3), reference[:3])
    again = Replicas(2, workers=2, state=job.merged(), stateful=True)
    assert _same(again.steps(2), reference[3:5])  # (within the pass: the test stream's next pass needs set_epoch)


def test_a_fit_shuts_the_workers_of_its_stream_loaders_down(tmp_path: Path) -> None:
    """Lightning shuts down at the end of a fit the workers of the loaders it sees, not those of the loader a stream
    wrapper holds: the strategy does. Left to Python's cycle collector they cost 5 s each at a later collection."""
    pytest.importorskip("torchdata")
    import lightning as L
    from torchdata.stateful_dataloader import StatefulDataLoader

    from tests.models import fit_in_this_process, make_model

    workers: list[Any] = []

    class SeeWorkers(L.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            workers[:] = loader._iterator._workers

    loader = StatefulDataLoader(StreamDataset(N), batch_size=BATCH, num_workers=2)
    fit_in_this_process(tmp_path, make_model(), loader, max_steps=2, callbacks=[SeeWorkers()])
    assert len(workers) == 2 and not any(w.is_alive() for w in workers)
    assert loader._iterator is None
