"""Durable checkpoints made of snapshot shares: each rank's snapshot files uploaded as they are.

    digests = upload_share(storage, rel, store, step, rank)      # this rank's two files and their records
    tensors = read_shares(storage, rel, manifest, needs)         # the named tensors, from the files holding them
    recycle(storage, old_rel)    # before deleting a local checkpoint: its tensor files become spares

With snapshots on, a durable checkpoint needs no second serialisation: the tensors file a snapshot
already wrote to host memory (``rankNNNNN.safetensors``, see ``checkpoint.tensorfile``) is copied to
storage (into a local directory with direct I/O or inside the kernel, elsewhere in chunks; the copy and
the writes release the GIL) with the size and CRC32C recorded when the snapshot was written (no second pass over the bytes),
and no collective plans the save; the manifest (kind ``"shares"``) lists each rank's share with the names it
holds. A reader picks, for the names it needs, the shares that hold them (its own first) and reads only
those files, checking each against its size and CRC32C.

In a local directory, the tensor files of checkpoints that retention deletes are kept in ``.spares/``
and written over by the next uploads (see ``checkpoint.memory.spares``); the pool holds at most one
checkpoint's worth and goes when training ends.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
from pathlib import Path
from typing import Any

import torch

from lightning_spot.checkpoint import checksum, tensorfile
from lightning_spot.checkpoint.checksum import ChecksumError
from lightning_spot.checkpoint.durable.storage import Storage, join
from lightning_spot.checkpoint.memory import spares
from lightning_spot.checkpoint.memory.snapshot import TENSORS, SnapshotStore, cover, share_name

KIND = "shares"
CHUNK = 8 * 2**20
DIRECT_ALIGN = 4096  # O_DIRECT: memory, offsets and lengths in whole blocks (4 KiB covers 512-byte devices)
DIRECT_CHUNK = 2**30  # bytes per write: Linux moves at most ~2 GiB per call
SPARES = ".spares"
Needs = dict[str, set[str]]


def upload_share(storage: Storage, rel: str, store: SnapshotStore, step: int, rank: int) -> dict[str, Any]:
    """Copy the share of ``rank`` at ``step`` from host memory into the checkpoint ``rel``; returns the files'
    records (the tensor file's size and CRC32C as the snapshot recorded them when writing it)."""
    tensors_name, json_name = share_name(rank, TENSORS), share_name(rank, ".json")
    sidecar = store.share_path(step, rank, ".json").read_bytes()
    recorded: dict[str, Any] = json.loads(sidecar)["meta"]["tensor_file"]
    source, target = store.share_path(step, rank, TENSORS), storage.path_of(join(rel, tensors_name))
    if storage.is_local:
        storage.fs.makedirs(storage.path_of(rel), exist_ok=True)
        spares.take(Path(storage.path_of(SPARES)), Path(target), recorded["size"])
        _copy_local(source, target, recorded)
    else:
        _copy_chunked(source, storage, target, recorded)
    storage.fs.pipe_file(storage.path_of(join(rel, json_name)), sidecar)
    return {tensors_name: recorded, json_name: checksum.digest(sidecar)}


def _copy_chunked(source: Path, storage: Storage, target: str, recorded: dict[str, Any]) -> None:
    """Copy a file to any storage in chunks, checked against its record as the bytes pass (nothing corrupt
    becomes durable)."""
    check = checksum.Verifier(recorded)
    with open(source, "rb") as src, storage.fs.open(target, "wb") as dst:
        while chunk := src.read(CHUNK):
            check.update(chunk)
            dst.write(chunk)
    check.done(str(source))


def _copy_local(source: Path, target: str, recorded: dict[str, Any]) -> None:
    """Copy a file into a local directory, over the target's bytes if it exists (a spare), then cut to size.
    The bytes are not read here: the checkpoint records the checksum computed when the snapshot was
    written, and readers verify it. The source is mapped and written with direct I/O where the target's
    filesystem allows it (the disk reads the tmpfs pages itself: no copy into the page cache by the CPU,
    ~0.4-1 ms of CPU time for 12.5 MB against ~4-5 ms); elsewhere ``sendfile`` copies inside the kernel."""
    with open(source, "rb") as src:
        size = os.fstat(src.fileno()).st_size
        if size != recorded["size"]:
            raise ChecksumError(f"{source} has {size} bytes, its snapshot recorded {recorded['size']}")
        done = _write_direct(src.fileno(), target, size)
        dst = os.open(target, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.lseek(dst, done, os.SEEK_SET)  # sendfile writes at the target's position
            while done < size:
                done += os.sendfile(dst, src.fileno(), done, size - done)
            os.ftruncate(dst, size)
        finally:
            os.close(dst)


def _write_direct(source: int, target: str, size: int) -> int:
    """Write the whole blocks of the file ``source`` into ``target`` with ``O_DIRECT``; returns the bytes written
    (0 where the filesystem has no direct I/O, or for files under one block)."""
    whole = size - size % DIRECT_ALIGN
    if whole == 0 or not hasattr(os, "O_DIRECT"):
        return 0
    try:
        dst = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError as err:
        if err.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return 0
        raise
    done = 0
    try:
        with mmap.mmap(source, size, prot=mmap.PROT_READ) as mapped:
            view = memoryview(mapped)
            try:
                while done < whole:  # page-aligned memory, block-aligned offsets and lengths
                    sent = os.pwrite(dst, view[done : min(whole, done + DIRECT_CHUNK)], done)
                    if sent <= 0 or sent % DIRECT_ALIGN:
                        done += max(sent, 0)
                        break
                    done += sent
            except OSError as err:  # refused part way (alignment, a filesystem's limits): the rest by sendfile
                if err.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
            finally:
                view.release()
    finally:
        os.close(dst)
    return done


def recycle(storage: Storage, rel: str) -> None:
    """Before the local checkpoint ``rel`` is deleted: keep its tensor files as spares (the pool holds at most
    as many files as one checkpoint has)."""
    if not storage.is_local:
        return
    files = sorted(Path(storage.path_of(rel)).glob(f"rank*{TENSORS}"))
    for path in files:
        spares.keep(path, Path(storage.path_of(SPARES)), limit=len(files))


def clear_spares(storage: Storage) -> None:
    if storage.is_local:
        spares.clear(Path(storage.path_of(SPARES)))


def _read_verified(storage: Storage, rel: str, name: str, expected: dict[str, Any]) -> bytes:
    data: bytes = storage.fs.cat_file(storage.path_of(join(rel, name)))
    checksum.verify(data, expected, name)
    return data


def read_shares(
    storage: Storage, rel: str, manifest: dict[str, Any], needs: Needs, *, prefer: int | None = None
) -> dict[str, dict[str, torch.Tensor]]:
    """The tensors named in ``needs`` (group -> names) from the shares of checkpoint ``rel`` that hold them."""
    shares = {int(r): meta["names"] for r, meta in manifest["shares"].items()}
    used, missing = cover(needs, [(r, shares[r]) for r in sorted(shares, key=lambda r: (r != prefer, r))])
    if missing:
        raise ChecksumError(f"no share of {rel} holds {len(missing)} needed tensor(s), e.g. {missing[0]}")
    out: dict[str, dict[str, torch.Tensor]] = {}
    for old, take in used:
        name = share_name(old, TENSORS)
        data = bytearray(_read_verified(storage, rel, name, manifest["files"][name]))
        tensors = tensorfile.decode(data, storage.url_of(join(rel, name)))
        for g, names in take.items():
            out.setdefault(g, {}).update({n: tensors[g][n] for n in names})
    return out


def read_share_state(storage: Storage, rel: str, manifest: dict[str, Any], rank: int) -> dict[str, Any] | None:
    """The JSON part of the share of ``rank`` (random states, ...), or ``None`` if it has none."""
    name = share_name(rank, ".json")
    if name not in manifest["files"]:
        return None
    state: dict[str, Any] = storage.read_json(join(rel, name), expected=manifest["files"][name])["state"]
    return state
