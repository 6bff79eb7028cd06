"""How a snapshot's bytes travel: copied once into a mapped tmpfs file (parameters and optimizer state by the
background thread, before the next optimizer step), checked against their version counters, and uploaded to a
local directory with direct I/O. One process, no process group."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_spot.checkpoint import tensorfile
from lightning_spot.checkpoint.memory import snapshotter as snapshotter_module
from lightning_spot.checkpoint.memory.mapped import FileMaps
from lightning_spot.checkpoint.memory.snapshot import SnapshotStore
from lightning_spot.checkpoint.memory.snapshotter import Snapshotter

LAYOUT = {"pipeline_stages": 1, "data_parallel": 1}


def _checkpoint(step: int, model: dict[str, torch.Tensor], moments: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {"state_dict": model, "optimizer_states": [moments], "global_step": step, "loops": {"step": step}}


def _state(seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    model = {"w": torch.randn(64, 32, generator=g), "bn.running_mean": torch.randn(32, generator=g)}
    moments = {"state.w.exp_avg": torch.randn(64, 32, generator=g), "state.w.step": torch.tensor(float(seed))}
    return model, moments


def _snapshotter(tmp_path: Path) -> Snapshotter:
    store = SnapshotStore(tmp_path / "shm")
    store.check()
    return Snapshotter(store, None, rank=0, world=1, local_world=1, stage_of=lambda r: 0)


def _take(taker: Snapshotter, step: int, state: tuple[dict, dict]) -> None:
    share = taker.copy(_checkpoint(step, *state), step, now=frozenset({"bn.running_mean"}))
    taker.take(share, {"step": step, "layout": LAYOUT})


def test_after_the_first_snapshot_the_copy_goes_straight_into_a_prepared_mapped_file(tmp_path: Path) -> None:
    taker = _snapshotter(tmp_path)
    store = taker.store
    for step in (1, 2, 3, 4, 5):
        state = _state(step)
        _take(taker, step, state)
        taker.wait()
        got = store.read_tensors(step, 0)
        assert torch.equal(got["model"]["w"], state[0]["w"])
        assert torch.equal(got["optimizer_0"]["state.w.step"], state[1]["state.w.step"])
        assert store.read_state(step, 0)["info"]["step"] == step
    assert [t["mapped"] for t in taker.taken] == [False, True, True, True, True], "the first one had no spare"
    # steady state: the rank's files are recycled (two kept, one spare), each mapped once
    files = {p.stat().st_ino for p in store.path.rglob("*") if p.is_file() and not p.name.endswith(".json")}
    assert len(files) == 3, files
    assert len(store.maps._maps) <= 3 and {m.key[1] for m in store.maps._maps.values()} <= files
    taker.close()
    assert not store.path.exists() and not store.maps._maps


def test_parameters_and_optimizer_state_are_copied_by_the_background_thread_before_the_next_update(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The background thread is held back: the buffer named ``now`` is copied at once, the rest only later; an
    update after ``wait_copied`` does not reach the snapshot."""
    taker = _snapshotter(tmp_path)
    for step in (1, 2):  # the second one finds a mapped spare
        _take(taker, step, _state(step))
        taker.wait()
    held: list[Any] = []
    monkeypatch.setattr(snapshotter_module, "start_background", lambda target, *args: held.append((target, args)))
    model, moments = _state(3)
    want_w, want_mean = model["w"].clone(), model["bn.running_mean"].clone()
    _take(taker, 3, (model, moments))
    target, args = held[0]
    staged = args[1].tensors  # the share's file, handed to the background thread
    assert torch.equal(staged["model"]["bn.running_mean"], want_mean), "a buffer: copied on the training thread"
    assert not torch.equal(staged["model"]["w"], want_w), "a parameter: left to the background thread"
    target(*args)  # the background thread runs (while the next forward and backward would)
    taker.wait_copied()
    model["w"].add_(1.0)  # the optimizer step
    taker.thread = None
    assert torch.equal(taker.store.read_tensors(3, 0)["model"]["w"], want_w)
    assert taker.defer and not taker.changed(3)


def test_a_tensor_changed_before_the_background_copy_drops_that_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    taker = _snapshotter(tmp_path)
    for step in (1, 2):
        _take(taker, step, _state(step))
        taker.wait()
    held: list[Any] = []
    monkeypatch.setattr(snapshotter_module, "start_background", lambda target, *args: held.append((target, args)))
    model, moments = _state(3)
    _take(taker, 3, (model, moments))
    moments["state.w.exp_avg"].mul_(2.0)  # changed in place before the copy (not by an optimizer step)
    with caplog.at_level("WARNING"):
        held[0][0](*held[0][1])
    taker.thread = None
    assert taker.changed(3) and not taker.defer
    assert "optimizer_0/state.w.exp_avg changed in place" in caplog.text
    assert sorted(taker.store.shares()) == [1, 2], "the step's share was not committed"
    assert not list(taker.store.path.glob("step-000000003/*")), "nor left behind"
    monkeypatch.undo()
    model, moments = _state(4)
    _take(taker, 4, (model, moments))  # from now on: every copy on the training thread
    moments["state.w.exp_avg"].mul_(2.0)
    taker.wait()
    assert torch.equal(
        taker.store.read_tensors(4, 0)["optimizer_0"]["state.w.exp_avg"], _state(4)[1]["state.w.exp_avg"]
    )


def test_a_mapping_follows_its_file_through_renames_and_goes_with_it(tmp_path: Path) -> None:
    maps = FileMaps()
    path = tmp_path / "a.safetensors"
    path.write_bytes(b"\0" * 100)
    laid = tensorfile.layout({"model": {"w": torch.ones(8)}})
    mapped = maps.open(path, laid.size)
    mapped.views(laid)["model"]["w"].copy_(torch.arange(8.0))
    moved = tmp_path / "b.safetensors"
    path.rename(moved)
    assert maps.open(moved, laid.size) is mapped, "the same inode: the same mapping"
    assert torch.equal(tensorfile.read_file(moved, expected=mapped.record())["model"]["w"], torch.arange(8.0))
    keep_alive = mapped.views(laid)["model"]["w"]
    moved.unlink()
    maps.release_deleted()
    assert not maps._maps, "a deleted file's mapping is released"
    assert keep_alive.sum() == 28.0, "tensors still viewing it stay valid"


@pytest.mark.parametrize("size", [100, 4096, 3 * 4096 + 5, 2**20 + 17])
@pytest.mark.parametrize("direct", [True, False], ids=["direct-io", "no-direct-io"])
def test_a_local_upload_writes_the_same_bytes_with_or_without_direct_io(
    tmp_path: Path, size: int, direct: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from lightning_spot.checkpoint.durable import from_snapshot

    if direct:
        try:
            os.close(os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
        except (AttributeError, OSError):
            pytest.skip("the temporary directory's filesystem has no direct I/O")
    opened = []
    real_open = os.open

    def open_(path: Any, flags: int, *args: Any) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            opened.append(path)
            if not direct:  # a filesystem without direct I/O
                raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(from_snapshot.os, "open", open_)
    source = tmp_path / "source"
    data = os.urandom(size)
    source.write_bytes(data)
    target = tmp_path / "run" / "rank00000.safetensors"
    target.parent.mkdir()
    target.write_bytes(b"x" * (size + 9000))  # a larger spare, written over
    inode = target.stat().st_ino
    from_snapshot._copy_local(source, str(target), {"size": size})
    assert target.read_bytes() == data and target.stat().st_ino == inode
    assert len(opened) == (size >= 4096), "direct I/O is tried for files of a block or more"
    if direct:  # this machine's disk takes it: the whole blocks went that way
        with open(source, "rb") as src:
            assert from_snapshot._write_direct(src.fileno(), str(target), size) == size - size % 4096


def test_a_checkpoint_whose_copy_changed_is_written_by_no_rank(tmp_path: Path) -> None:
    from lightning_spot.checkpoint.durable.storage import Storage
    from lightning_spot.checkpoint.durable.write import write_checkpoint
    from lightning_spot.checkpoint.payload import Payload

    storage = Storage(str(tmp_path / "run"))
    payload = Payload(tensors={"model": {"w": torch.ones(3)}}, optimizer_values=[], rng=None, lightning={})
    assert write_checkpoint(storage, "step-000000002", payload, info={"step": 2}, discard=True) is None
    assert storage.committed() == [] and not (tmp_path / "run" / "step-000000002").exists()


def test_a_snapshots_stall_counts_its_copy_when_the_copy_was_made_before_take(tmp_path: Path) -> None:
    """SpotCheckpoint copies first (into the shared staging buffers on a GPU: all of the stall) and then hands the
    share to ``take``: the recorded stall, which the cadence budgets, starts before the copy."""
    import time

    taker = _snapshotter(tmp_path)
    for step in (1, 2):  # the first into staging buffers, the second into a mapped spare
        start = time.monotonic()
        share = taker.copy(_checkpoint(step, *_state(step)), step)
        time.sleep(0.2)  # a copy this slow
        stall = taker.take(share, {"step": step, "layout": LAYOUT}, since=start)
        taker.wait()
        assert stall >= 0.2 and taker.taken[-1]["stall_seconds"] == stall


def test_a_snapshot_copies_into_the_staging_buffers_only_once_the_upload_has_read_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Snapshots and durable saves share one set of host buffers. Here every copy goes into them (as on a GPU:
    no mapped spare) and the save at step 2 is uploaded from them as DCP shards, slowly (0.6 s): the snapshot of
    step 3 waits until the upload has read them, so the checkpoint holds step 2's weights, not step 3's."""
    import lightning as L

    from lightning_spot import SpotCheckpoint
    from lightning_spot.checkpoint.durable import write
    from lightning_spot.checkpoint.tools.consolidate import load_full_state_dict
    from tests.models import fit_in_this_process, make_loader, make_model

    save_shards = write.save_shards

    def slow_save_shards(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.6)  # the buffers are read after this, as a slow upload reads its last shards
        return save_shards(*args, **kwargs)

    monkeypatch.setattr(SnapshotStore, "stage", lambda *args: None)
    monkeypatch.setattr(SnapshotStore, "has_share", lambda *args: False)
    monkeypatch.setattr(write, "save_shards", slow_save_shards)

    class WeightsAtStep2(L.Callback):
        def __init__(self) -> None:
            self.weights: dict[str, torch.Tensor] = {}

        def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
            if trainer.global_step == 2:
                self.weights = {k: v.detach().clone() for k, v in module.state_dict().items()}

    spot = SpotCheckpoint(
        str(tmp_path / "run"),
        snapshot_dir=str(tmp_path / "shm"),
        snapshot_every_n_train_steps=1,
        every_n_train_steps=2,
        keep_last=5,
        save_on_train_end=False,
        preemption=False,
    )
    recorded = WeightsAtStep2()
    fit_in_this_process(tmp_path, make_model(), make_loader(), max_steps=3, callbacks=[recorded, spot])
    assert [s["step"] for s in spot.saves] == [2]
    saved = load_full_state_dict(str(tmp_path / "run"))
    assert recorded.weights and saved.keys() == recorded.weights.keys()
    for name, value in recorded.weights.items():
        assert torch.equal(saved[name], value), f"{name}: the checkpoint of step 2 holds another step's value"
    assert spot.snapshotter is not None and spot.snapshotter.taken[-1]["step"] == 3
    assert spot.snapshotter.taken[-1]["stall_seconds"] > 0.3, "the snapshot of step 3 waited for the upload"
