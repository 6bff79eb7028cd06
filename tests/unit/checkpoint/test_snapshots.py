"""In-memory snapshots: committed whole or ignored, bounded, and a worker restart resumes from them.

The torchrun test kills a worker with no durable checkpoint since the start: torchrun restarts the node's
workers, which resume from the snapshot in host memory and end equal to an uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_spot.checkpoint import tensorfile
from lightning_spot.checkpoint.durable.storage import Storage
from lightning_spot.checkpoint.memory.recall import Recall, Source
from lightning_spot.checkpoint.memory.snapshot import SnapshotError, SnapshotStore
from lightning_spot.checkpoint.memory.snapshotter import needs_peer_copy

LAYOUT = {"pipeline_stages": 2, "data_parallel": 1}


STATE = {"rng": None, "optimizer_values": [{"param_groups.a.lr": 0.1}], "lightning": {"global_step": 0}, "info": {}}


def _write(store: SnapshotStore, step: int, rank: int, names: list[str], pp_rank: int = 0) -> None:
    tensors = {"model": {n: torch.full((3,), float(step)) for n in names}}
    meta = {"names": {"model": names}, "layout": LAYOUT, "pp_rank": pp_rank}
    store.write(step, rank, tensorfile.encode(tensors), meta, {**STATE, "info": {"step": step}})


def test_a_share_exists_once_written_whole(tmp_path: Path) -> None:
    store = SnapshotStore.for_run("s3://bucket/run", str(tmp_path))
    store.check()
    for step in (2, 4):
        for rank in (0, 1):
            _write(store, step, rank, [f"w{rank}"], pp_rank=rank)
    (store.path / "step-000000006").mkdir()
    (store.path / "step-000000006" / "rank00000.safetensors").write_bytes(b"torn")  # killed before its description
    shares = store.shares()
    assert sorted(shares) == [2, 4] and sorted(shares[4]) == [0, 1]
    assert shares[4][1]["names"] == {"model": ["w1"]} and shares[4][1]["pp_rank"] == 1
    assert torch.equal(store.read_tensors(4, 1)["model"]["w1"], torch.full((3,), 4.0))
    assert store.read_state(4, 1)["info"] == {"step": 4}
    (store.path / "step-000000004" / "rank00001.safetensors").unlink()  # a share's tensors vanished
    assert sorted(store.shares()[4]) == [0]
    assert not list(store.path.glob("step-*/.*.tmp")), "temporary files are renamed into place"


def test_a_snapshot_share_whose_bytes_changed_in_memory_is_refused_and_dropped(tmp_path: Path) -> None:
    from lightning_spot.checkpoint.checksum import ChecksumError

    store = SnapshotStore(tmp_path)
    _write(store, 2, 0, ["w"])
    path = store.share_path(2, 0, ".safetensors")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40  # a flipped bit in a tensor: the file still parses
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match=r"rank00000.safetensors fails its checksum.*corrupt and was dropped"):
        store.read_tensors(2, 0)
    assert store.shares() == {}, "no restart picks it again (storage or an older step is used)"


def test_snapshots_are_bounded_recycled_pinned_dropped_after_a_resume_and_cleared(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "run")
    inodes = {}
    for step in (1, 2, 3, 4):
        store.write(step, 0, {"model": {"w": torch.full((1000 // step,), float(step))}}, _meta(0, ["w"]), STATE)
        inodes[step] = store.share_path(step, 0, ".safetensors").stat().st_ino
        store.retire([0], keep=2)
    assert sorted(store.shares()) == [3, 4]
    assert inodes[4] == inodes[1], "a retired tensor file is written over, not a new one made"
    assert torch.equal(store.read_tensors(4, 0)["model"]["w"], torch.full((250,), 4.0)), "cut to its new size"
    assert store.share_path(4, 0, ".safetensors").stat().st_size < 2000, "step 1 wrote 4000 bytes of tensors"
    store.pin(3, 0)  # an upload reads step 3: it outlives its turn, and is retired once unpinned
    store.write(5, 0, {"model": {"w": torch.full((3,), 5.0)}}, _meta(0, ["w"]), STATE)
    store.retire([0], keep=2)
    store.prune(keep=2)  # the node's clean-up spares it too
    assert sorted(store.shares()) == [3, 4, 5]
    store.unpin(3, 0)
    store.retire([0], keep=2)
    assert sorted(store.shares()) == [4, 5] and not (store.path / "step-000000003").exists()
    store.drop_after(4)
    assert sorted(store.shares()) == [4]
    store.clear()
    assert not store.path.exists()


def _recall(store: SnapshotStore, held: list[dict], needs: list[dict], me: int = 0) -> Recall:
    recall = Recall(store, [f"node{i}" for i in range(len(held))], held, needs)
    recall.me = me
    return recall


def _meta(pp_rank: int, names: list[str]) -> dict[str, Any]:
    return {"names": {"model": names}, "layout": LAYOUT, "pp_rank": pp_rank}


def test_recall_finds_the_newest_step_that_covers_every_ranks_needs(tmp_path: Path) -> None:
    """Old P2xD2 (stage 0: a, b; stage 1: c, d); two new ranks on one node each; a new P2xD1 layout."""
    stage0, stage1 = _meta(0, ["a", "b"]), _meta(1, ["c", "d"])
    held = [
        {8: {0: stage0, 1: stage0}, 6: {0: stage0, 1: stage0}},  # node 0: its own shares of stage 0
        {8: {}, 6: {2: stage1}},  # node 1: step 8's copy of stage 1 was lost mid-write
    ]
    needs = [{"model": ["a", "b"]}, {"model": ["c", "d"]}]
    recall = _recall(SnapshotStore(tmp_path), held, needs)
    assert recall.newest_complete()[0] == 6
    assert "step 8" in recall.newest_complete()[1] and "model/c" in recall.newest_complete()[1]
    plan, _ = recall.plan(6)
    assert plan is not None
    assert plan[0] == [Source(reader=0, old_rank=0, names={"model": ["a", "b"]})], "its own share, read locally"
    assert plan[1] == [Source(reader=1, old_rank=2, names={"model": ["c", "d"]})]
    # one rank of a new P1xD2 needs everything: what its node lacks comes from the other node
    whole = _recall(SnapshotStore(tmp_path), held, [{"model": ["a", "b", "c", "d"]}] * 2)
    plan, _ = whole.plan(6)
    assert plan is not None
    assert plan[0] == [Source(0, 0, {"model": ["a", "b"]}), Source(1, 2, {"model": ["c", "d"]})]
    assert _recall(SnapshotStore(tmp_path), [{}, {}], needs).newest_complete() == (None, "no snapshot survives")


def test_recall_gives_every_rank_its_names_of_the_model_copies_a_step_holds(tmp_path: Path) -> None:
    """A checkpoint entry that copies the model's state (EMAWeightAveraging's trained weights beside the average) is
    recalled by the model's names, onto any layout; a step whose copies lack a name is not complete."""
    stage0 = {**_meta(0, ["a", "b"]), "names": {"model": ["a", "b"], "copy:current_model_state": ["a", "b"]}}
    stage1 = {**_meta(1, ["c"]), "names": {"model": ["c"], "copy:current_model_state": ["c"]}}
    lost_copy = {**_meta(1, ["c"]), "names": {"model": ["c"], "copy:current_model_state": []}}
    held = [{8: {0: stage0, 1: lost_copy}, 6: {0: stage0, 1: stage1}}]
    recall = _recall(SnapshotStore(tmp_path), held, [{"model": ["a", "b", "c"]}])
    assert recall.newest_complete()[0] == 6 and "copy:current_model_state/c" in recall.newest_complete()[1]
    plan, _ = recall.plan(6)
    assert plan is not None
    assert plan[0] == [
        Source(0, 0, {"model": ["a", "b"], "copy:current_model_state": ["a", "b"]}),
        Source(0, 1, {"model": ["c"], "copy:current_model_state": ["c"]}),
    ]


def test_recall_reads_its_own_node_in_one_process(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    _write(store, 4, 0, ["a"], pp_rank=0)
    _write(store, 4, 1, ["b"], pp_rank=1)
    recall = Recall.gather(store, {"model": ["a", "b"]})
    assert recall.newest_complete()[0] == 4
    got = recall.fetch(4)
    assert set(got.tensors["model"]) == {"a", "b"} and torch.equal(got.tensors["model"]["b"], torch.full((3,), 4.0))
    assert got.optimizer_values == [{"param_groups.a.lr": 0.1}] and got.info == {"step": 4}
    assert got.layout == LAYOUT


@pytest.mark.parametrize(
    ("world", "local_world", "data_parallel", "copy"),
    [(4, 2, 2, True), (4, 2, 1, True), (4, 4, 2, False), (4, 2, 4, False)],
)
def test_a_peer_copy_is_made_only_when_a_stage_lives_on_one_node(
    world: int, local_world: int, data_parallel: int, copy: bool
) -> None:
    """Ranks r // D share a stage; nodes hold consecutive ranks (P2xD2 on 2 nodes: each stage on one node)."""
    assert needs_peer_copy(world, local_world, lambda r: r // data_parallel) is copy


def test_unusable_snapshot_memory_fails_with_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(SnapshotError, match="Cannot keep snapshots in .*snapshot_dir"):
        SnapshotStore(blocker / "snapshots").check()
    with pytest.raises(SnapshotError, match="MiB free, but the snapshots of this node need about"):
        SnapshotStore(tmp_path / "ok").check(needed_bytes=2**62)


def test_too_little_memory_turns_snapshots_off_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A tmpfs too small for the node's snapshots: a warning with the figures, no snapshot, training goes on."""
    import shutil

    from lightning_spot.checkpoint.memory import snapshotter

    store = SnapshotStore(tmp_path / "shm")
    store.check()
    taker = snapshotter.Snapshotter(store, None, rank=0, world=1, local_world=1, stage_of=lambda r: 0)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(snapshotter.shutil, "disk_usage", lambda path: usage._replace(free=1000))
    checkpoint = {"state_dict": {"w": torch.ones(1000)}, "optimizer_states": [], "global_step": 2}
    with caplog.at_level("WARNING"):
        assert taker.take(checkpoint, {"step": 2, "layout": LAYOUT}) == 0.0
    assert not taker.enabled and store.shares() == {}
    assert "snapshots off" in caplog.text and "MiB free" in caplog.text and "shm-size" in caplog.text
    assert taker.take(checkpoint, {"step": 4, "layout": LAYOUT}) == 0.0, "and stay off"


def test_a_durable_checkpoint_from_a_snapshot_is_its_files_checked_when_read(tmp_path: Path) -> None:
    """write_checkpoint(snapshot=...) uploads the share's files as they are; a damaged one is refused by
    its CRC32C and the previous checkpoint is used."""
    from lightning_spot import load_full_state_dict
    from lightning_spot.checkpoint.durable.write import write_checkpoint
    from lightning_spot.checkpoint.payload import Payload

    store = SnapshotStore(tmp_path / "shm")
    storage = Storage(str(tmp_path / "run"))
    for step in (2, 4):
        _write(store, step, 0, ["a", "b"])
        payload = Payload(tensors={}, optimizer_values=[{}], rng=None, lightning={"global_step": step})
        manifest = write_checkpoint(storage, f"step-{step:09d}", payload, info={"step": step}, snapshot=(store, step))
        assert manifest is not None and manifest["kind"] == "shares"
        assert manifest["shares"] == {"0": {"names": {"model": ["a", "b"]}, "pp_rank": 0}}
    assert torch.equal(load_full_state_dict(str(tmp_path / "run"))["b"], torch.full((3,), 4.0))
    damaged = tmp_path / "run" / "step-000000004" / "rank00000.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-100] ^= 0xFF
    damaged.write_bytes(bytes(data))
    assert torch.equal(load_full_state_dict(str(tmp_path / "run"))["b"], torch.full((3,), 2.0)), "step 2 is used"


def test_an_upload_frees_the_staging_buffers_once_it_no_longer_reads_them(tmp_path: Path) -> None:
    """Snapshots and durable saves share one set of host buffers: an upload from the snapshot's files lets them go
    before it uploads anything; one that writes the copied tensors as shards, only once they are written."""
    from lightning_spot.checkpoint.durable.write import write_checkpoint
    from lightning_spot.checkpoint.payload import Payload

    store = SnapshotStore(tmp_path / "shm")
    storage = Storage(str(tmp_path / "run"))
    seen: list[list[str]] = []

    def release() -> None:  # what the step's directory holds when the buffers are let go
        step_dir = Path(storage.path_of(f"step-{2 * (len(seen) + 1):09d}"))
        seen.append(sorted(f.name for f in step_dir.iterdir()) if step_dir.exists() else [])

    _write(store, 2, 0, ["a"])
    payload = Payload(tensors={}, optimizer_values=[{}], rng=None, lightning={"global_step": 2})
    assert write_checkpoint(storage, "step-000000002", payload, info={"step": 2}, snapshot=(store, 2), release=release)
    payload = Payload(tensors={"model": {"w": torch.ones(3)}}, optimizer_values=[{}], rng=None, lightning={})
    assert write_checkpoint(storage, "step-000000004", payload, info={"step": 4}, release=release)
    assert seen[0] == [], "from the snapshot: released before any upload"
    assert any(name.endswith(".distcp") for name in seen[1]), f"as shards: released once written ({seen[1]})"
    assert storage.committed() == ["step-000000002", "step-000000004"]


def test_checkpoint_copies_reuse_their_host_buffers() -> None:
    from lightning_spot.checkpoint.payload import split_checkpoint
    from lightning_spot.checkpoint.staging import Staging

    staging = Staging()
    w = torch.ones(4, 4)
    first = split_checkpoint({"state_dict": {"w": w}}, copy=True, with_lightning=False, staging=staging)
    w.add_(1)  # training goes on: the copy keeps the step it was taken at
    assert torch.equal(first.tensors["model"]["w"], torch.ones(4, 4))
    second = split_checkpoint({"state_dict": {"w": w}}, copy=True, with_lightning=False, staging=staging)
    assert second.tensors["model"]["w"].data_ptr() == first.tensors["model"]["w"].data_ptr(), "the same buffer"
    assert torch.equal(second.tensors["model"]["w"], torch.full((4, 4), 2.0)) and staging.nbytes == 64


def test_a_share_uploads_the_same_bytes_and_checksums_to_a_local_directory_and_an_object_store(
    tmp_path: Path,
) -> None:
    """Local directories get the share copied inside the kernel (sendfile), other storage in chunks: the same
    files, and the records are those of the bytes (the tensor file's as its snapshot recorded it)."""
    from lightning_spot.checkpoint import checksum
    from lightning_spot.checkpoint.durable.from_snapshot import upload_share

    store = SnapshotStore(tmp_path / "shm")
    _write(store, 2, 0, ["a", "b"])
    local, remote = Storage(str(tmp_path / "run")), Storage("memory://spot-share-test/run")
    assert local.is_local and not remote.is_local
    digests = [upload_share(s, "step-000000002", store, 2, 0) for s in (local, remote)]
    assert digests[0] == digests[1] and digests[0]["rank00000.safetensors"]["size"] > 0
    for name, record in digests[0].items():
        assert checksum.digest((tmp_path / "run" / "step-000000002" / name).read_bytes()) == record
    for name in ("rank00000.safetensors", "rank00000.json"):
        assert (tmp_path / "run" / "step-000000002" / name).read_bytes() == remote.fs.cat_file(
            remote.path_of("step-000000002", name)
        )


def test_a_local_checkpoint_that_retention_deletes_lends_its_tensor_files_to_the_next_uploads(tmp_path: Path) -> None:
    from lightning_spot import load_full_state_dict
    from lightning_spot.checkpoint.durable.from_snapshot import SPARES, clear_spares, recycle
    from lightning_spot.checkpoint.durable.write import write_checkpoint
    from lightning_spot.checkpoint.payload import Payload

    store, storage = SnapshotStore(tmp_path / "shm"), Storage(str(tmp_path / "run"))
    inodes = {}
    for step in (2, 4):
        store.write(step, 0, {"model": {"w": torch.full((1000 // step,), float(step))}}, _meta(0, ["w"]), STATE)
        payload = Payload(tensors={}, optimizer_values=[{}], rng=None, lightning={"global_step": step})
        write_checkpoint(storage, f"step-{step:09d}", payload, info={"step": step}, snapshot=(store, step))
        inodes[step] = (tmp_path / "run" / f"step-{step:09d}" / "rank00000.safetensors").stat().st_ino
        if step == 2:
            recycle(storage, "step-000000002")  # retention is about to delete it
            storage.delete("step-000000002")
    assert inodes[4] == inodes[2], "the upload wrote over the retired file"
    assert storage.committed() == ["step-000000004"] and not list((tmp_path / "run" / SPARES).iterdir())
    assert torch.equal(load_full_state_dict(str(tmp_path / "run"))["w"], torch.full((250,), 4.0)), "cut, checked"
    clear_spares(storage)
    assert not (tmp_path / "run" / SPARES).exists()


def test_the_closing_line_gives_the_first_saves_stall_the_later_median_and_the_waits_for_uploads() -> None:
    from lightning_spot.checkpoint.saver import per_save as _per_save

    saves = [{"stall_seconds": s, "waited_seconds": w} for s, w in ((4.7, 0.0), (0.1, 0.0), (0.9, 0.8), (0.2, 0.0))]
    assert _per_save(saves) == (
        "; per save: the first 4.70s, then a median 0.20s (0.80s in all waiting for the previous upload: saves "
        "closer than an upload takes)"
    )
    assert _per_save(saves[:2]) == "; per save: the first 4.70s, then a median 0.10s"
    assert _per_save(saves[:1]) == "; per save: the first 4.70s"


def test_process_groups_of_one_run_keep_their_snapshots_apart(tmp_path: Path) -> None:
    """torchft's pipelines of one run on one node: one store each (keyed by replica group), not one between them."""
    run = SnapshotStore.for_run("s3://bucket/run", str(tmp_path))
    zero, one = (SnapshotStore.for_run("s3://bucket/run", str(tmp_path), part) for part in ("0", "1"))
    assert len({run.path, zero.path, one.path}) == 3
    assert SnapshotStore.for_run("s3://bucket/run/", str(tmp_path), "1").path == one.path
