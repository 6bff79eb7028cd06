"""Global batches do not depend on the layout: each replica loads its share of the same sequence."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.utilities.data import _auto_add_worker_init_fn
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    SequentialSampler,
    Subset,
    TensorDataset,
    default_collate,
    random_split,
)

from lightning_spot.data.sharded import EpochShuffleSampler, TensorRows, replica_slice, shard_dataloader


def _dataset(n: int = 40) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def _global_batches(dp_size: int, epoch: int, shuffle: bool = True) -> list[list[int]]:
    """Rebuild the global batches from what every replica loads."""
    loaders = [
        shard_dataloader(
            DataLoader(_dataset(), batch_size=8, shuffle=shuffle), dp_rank=r, dp_size=dp_size, divisor=dp_size, seed=3
        )
        for r in range(dp_size)
    ]
    for loader in loaders:
        loader.batch_sampler.set_epoch(epoch)
    per_replica = [[b[0].tolist() for b in loader] for loader in loaders]
    return [sum((per_replica[r][i] for r in range(dp_size)), []) for i in range(len(per_replica[0]))]


@pytest.mark.parametrize("epoch", [0, 1])
def test_global_batch_sequence_is_independent_of_data_parallel_width(epoch: int) -> None:
    one = _global_batches(1, epoch)
    assert _global_batches(2, epoch) == one
    assert _global_batches(4, epoch) == one
    # same permutation rule as DistributedSampler(num_replicas=1, seed=...)
    reference = DistributedSampler(_dataset(), num_replicas=1, rank=0, shuffle=True, seed=3)
    reference.set_epoch(epoch)
    assert sum(one, []) == list(reference)


def test_shuffle_changes_with_epoch_and_seed() -> None:
    assert _global_batches(2, 0) != _global_batches(2, 1)
    a, b = EpochShuffleSampler(range(50), seed=1), EpochShuffleSampler(range(50), seed=2)
    assert list(a) != list(b) and sorted(a) == list(range(50))


def test_replicas_load_disjoint_contiguous_shares() -> None:
    shares = [replica_slice(10, r, 3) for r in range(3)]
    assert [(s.start, s.stop) for s in shares] == [(0, 4), (4, 7), (7, 10)]


def test_user_samplers_are_kept() -> None:
    loader = DataLoader(_dataset(), batch_size=8, sampler=SequentialSampler(range(40)))
    sharded = shard_dataloader(loader, dp_rank=1, dp_size=2, divisor=None, seed=0)
    assert isinstance(sharded.batch_sampler.batch_sampler.sampler, SequentialSampler)
    assert [b[0].tolist() for b in sharded][0] == [4, 5, 6, 7]


def test_iterable_datasets_are_refused_with_a_reason() -> None:
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):  # type: ignore[override]
            yield from range(10)

    from lightning_spot import LayoutError

    with pytest.raises(LayoutError, match="IterableDataset cannot be sharded that way.*stream_dataloader"):
        shard_dataloader(DataLoader(Stream(), batch_size=2), dp_rank=0, dp_size=2, divisor=None, seed=0)


def test_indivisible_global_batch_error_lists_every_way_out() -> None:
    from lightning_spot.data.sharded import explain_indivisible_batch

    message = explain_indivisible_batch(12, 2, 4, world_size=4)
    assert "multiple of 8 (e.g. [8, 16, 24, 32])" in message
    assert "pipeline_stages=4 (D=1)" in message, "a layout that keeps the global batch"
    assert "microbatches in [1, 2, 3, 6]" in message


def test_resuming_with_another_global_batch_is_refused() -> None:
    from lightning_spot import LayoutError

    loader = shard_dataloader(DataLoader(_dataset(), batch_size=8), dp_rank=0, dp_size=2, divisor=2, seed=0)
    loader.load_state_dict({"epoch": 0, "global_batches_done": 2, "global_batch_size": 8})  # same batch: fine
    assert [b[0].tolist() for b in loader][0] == [16, 17, 18, 19], "resumes after the first two global batches"
    with pytest.raises(LayoutError, match="trained with a global batch of 16 samples .* batch_size=8"):
        loader.load_state_dict({"epoch": 0, "global_batches_done": 2, "global_batch_size": 16})


def _epoch_order(epoch: int) -> list[list[int]]:
    """The global batches of ``epoch`` in a run that was never interrupted (one replica, 5 batches of 8)."""
    loader = shard_dataloader(
        DataLoader(_dataset(), batch_size=8, shuffle=True), dp_rank=0, dp_size=1, divisor=1, seed=3
    )
    loader.batch_sampler.set_epoch(epoch)
    return [b[0].tolist() for b in loader]


def test_checkpoints_record_the_epoch_that_lightning_starts() -> None:
    """Lightning calls ``set_epoch`` on ``batch_sampler.sampler`` only: the recorded epoch must follow it."""
    from lightning.fabric.utilities.data import _set_sampler_epoch

    loader = shard_dataloader(
        DataLoader(_dataset(), batch_size=8, shuffle=True), dp_rank=0, dp_size=1, divisor=1, seed=3
    )
    loader.progress = lambda: 5
    for epoch in (0, 1, 2):
        _set_sampler_epoch(loader, epoch)
        assert [b[0].tolist() for b in loader] == _epoch_order(epoch)
        assert loader.state_dict()["epoch"] == epoch


@pytest.mark.parametrize("lightning_epoch", [2, 1], ids=["lightning-in-step", "lightning-one-behind"])
def test_a_resume_at_the_end_of_an_epoch_draws_the_next_epoch(lightning_epoch: int) -> None:
    """Resumed from a checkpoint of the last batch of epoch 1, the next epoch is 2, whatever number Lightning
    gives it: after two such resumes in a row, Lightning restarts the finished epoch's number (1)."""
    from lightning.fabric.utilities.data import _set_sampler_epoch

    loader = shard_dataloader(
        DataLoader(_dataset(), batch_size=8, shuffle=True), dp_rank=0, dp_size=1, divisor=1, seed=3
    )
    loader.progress = lambda: 5
    loader.load_state_dict({"epoch": 1, "global_batches_done": 5, "global_batch_size": 8})
    for offset in (0, 1):  # the epoch after it keeps the same difference
        _set_sampler_epoch(loader, lightning_epoch + offset)
        assert [b[0].tolist() for b in loader] == _epoch_order(2 + offset)
        assert loader.state_dict()["epoch"] == 2 + offset
    assert _epoch_order(1) != _epoch_order(2)


def _fields() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(40, 3, generator=g), torch.arange(40), torch.randint(0, 5, (40, 2, 2), dtype=torch.int8)
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_tensor_datasets_are_read_whole_with_what_default_collate_gives(workers: int) -> None:
    """A plain TensorDataset is read one index per tensor (TensorRows): the same list of tensors, dtypes and shapes
    as one __getitem__ per sample and default_collate, in memory of its own (not a view of the dataset)."""
    dataset = _fields()
    owned = {t.untyped_storage().data_ptr() for t in dataset.tensors}
    rows_read: list[int] = []
    for dp_rank in (0, 1):
        loader = DataLoader(dataset, batch_size=8, shuffle=True, num_workers=workers)
        sharded = shard_dataloader(loader, dp_rank=dp_rank, dp_size=2, divisor=None, seed=5)
        assert isinstance(sharded.dataset, TensorRows) and sharded.dataset.tensors == dataset.tensors
        got = list(sharded)
        shares = list(sharded.batch_sampler)
        assert len(got) == len(shares) == 5
        for batch, rows in zip(got, shares):
            want = default_collate([dataset[i] for i in rows])
            assert type(batch) is type(want) is list and len(batch) == len(want) == 3
            for tensor, wanted in zip(batch, want):
                assert tensor.dtype == wanted.dtype and tensor.shape == wanted.shape and torch.equal(tensor, wanted)
                assert tensor.untyped_storage().data_ptr() not in owned
            rows_read += batch[1].tolist()
    assert sorted(rows_read) == list(range(40)) and rows_read != list(range(40))  # all rows once, shuffled


def test_subsets_of_tensor_datasets_are_read_whole_too() -> None:
    """random_split's Subset of a plain TensorDataset: its rows (mapped through the subset's indices) in one call."""
    dataset = _fields()
    train, _ = random_split(dataset, [0.75, 0.25], generator=torch.Generator().manual_seed(2))
    sharded = shard_dataloader(DataLoader(train, batch_size=6), dp_rank=1, dp_size=2, divisor=None, seed=0)
    assert type(sharded.dataset) is Subset and isinstance(sharded.dataset.dataset, TensorRows)
    got, shares = list(sharded), list(sharded.batch_sampler)
    assert len(got) == len(shares) == 5
    for batch, rows in zip(got, shares):
        want = default_collate([train[i] for i in rows])
        assert all(t.dtype == w.dtype and torch.equal(t, w) for t, w in zip(batch, want)) and len(batch) == 3
    assert sum(len(b[1]) for b in got) == 15 and set(sum((b[1].tolist() for b in got), [])) <= set(train.indices)


def test_tensor_rows_stay_away_from_subclasses_and_collate_functions_of_the_user() -> None:
    class Doubled(TensorDataset):
        def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
            return tuple(2 * t for t in super().__getitem__(index))

    def as_dict(samples: list[tuple[torch.Tensor, ...]]) -> dict[str, torch.Tensor]:
        return {"x": torch.stack([s[0] for s in samples])}

    sub = shard_dataloader(
        DataLoader(Doubled(torch.arange(8)), batch_size=4), dp_rank=0, dp_size=1, divisor=None, seed=0
    )
    assert type(sub.dataset) is Doubled and next(iter(sub))[0].tolist() == [0, 2, 4, 6]
    own = shard_dataloader(
        DataLoader(_dataset(8), batch_size=4, collate_fn=as_dict), dp_rank=0, dp_size=1, divisor=None, seed=0
    )
    assert type(own.dataset) is TensorDataset and next(iter(own))["x"].tolist() == [0, 1, 2, 3]


def _rng_states() -> tuple:
    import random

    import numpy as np

    return torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()


def _same_states(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and a[1] == b[1] and (a[2] == b[2]).all()


@pytest.mark.parametrize("workers", [0, 2])
def test_every_stage_of_a_replica_draws_its_random_samples_alike(workers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two stages of one replica, in different random states (their models drew differently), read the same
    batches from a WeightedRandomSampler over random crops (torch, random and NumPy draws), and the draws leave
    the process's own generators as they were."""
    from tests.models import make_loader

    def read(process_seed: int, global_rank: int) -> list[list[torch.Tensor]]:
        torch.manual_seed(process_seed)
        loader = make_loader(batch_size=16, n=64, random_draws=True, num_workers=workers)
        sharded = shard_dataloader(loader, dp_rank=1, dp_size=2, divisor=2, seed=5)
        # with workers, as Lightning seeds them after seed_everything(workers=True), once the strategy has processed
        # the loader: with the process's global rank where the loader has no worker_init_fn
        _auto_add_worker_init_fn(sharded, global_rank)
        sharded.batch_sampler.set_epoch(1)
        before = _rng_states()
        batches = list(sharded)
        assert _same_states(before, _rng_states()), "reading the data changed the process's random states"
        return batches

    if workers:
        monkeypatch.setenv("PL_SEED_WORKERS", "1")
    first, last = read(0, global_rank=2), read(1, global_rank=3)  # the two stages of replica 1
    assert len(first) == 4 and all(len(x) == 8 for x, _ in first)
    for (x0, y0), (x1, y1) in zip(first, last):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)
    # the other replica draws its own crops; the next epoch draws anew
    other = shard_dataloader(
        make_loader(batch_size=16, n=64, random_draws=True), dp_rank=0, dp_size=2, divisor=2, seed=5
    )
    other.batch_sampler.set_epoch(1)
    assert not torch.equal(next(iter(other))[0], first[0][0])
    later = shard_dataloader(
        make_loader(batch_size=16, n=64, random_draws=True), dp_rank=1, dp_size=2, divisor=2, seed=5
    )
    later.batch_sampler.set_epoch(2)
    assert not torch.equal(next(iter(later))[0], first[0][0])


def test_a_users_distributed_sampler_gives_the_whole_datasets_order() -> None:
    """A DistributedSampler made for 4 processes: each rank read its quarter, so the stages of a pipeline read
    different rows. Every rank now reads the order of one process's sampler (shuffle and seed kept), split by
    the replicas."""
    dataset = _dataset()
    one = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=3)
    one.set_epoch(1)
    order = list(one)
    for rank in range(4):
        user = DistributedSampler(dataset, num_replicas=4, rank=rank, shuffle=True, seed=3)
        loaders = [
            shard_dataloader(DataLoader(dataset, batch_size=8, sampler=user), dp_rank=r, dp_size=2, divisor=2, seed=0)
            for r in range(2)
        ]
        for loader in loaders:
            loader.batch_sampler.set_epoch(1)
        read = [[b[0].tolist() for b in loader] for loader in loaders]
        assert sum((read[0][i] + read[1][i] for i in range(5)), []) == order
        assert user.num_replicas == 4 and user.rank == rank  # the user's sampler itself is left alone


def test_loaders_that_draw_nothing_read_as_before() -> None:
    """A TensorDataset in order or shuffled by the strategy draws nothing from the process: no seeding there."""
    for shuffle in (False, True):
        sharded = shard_dataloader(
            DataLoader(_dataset(), batch_size=8, shuffle=shuffle), dp_rank=0, dp_size=1, divisor=None, seed=0
        )
        assert sharded.draw_seed is None and sharded.batch_sampler.draw_seed is None
