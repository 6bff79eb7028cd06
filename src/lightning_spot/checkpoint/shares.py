"""Durable checkpoints made of snapshot shares: each rank's snapshot files uploaded as they are.

    digests = upload_share(storage, rel, store, step, rank)      # this rank's two files, CRC32 as they pass
    tensors = read_shares(storage, rel, manifest, needs)         # the named tensors, from the files holding them
    recycle(storage, old_rel)    # before deleting a local checkpoint: its tensor files become spares

With snapshots on, a durable checkpoint needs no second serialisation: the tensors file a snapshot
already wrote to host memory (``rankNNNNN.safetensors``, see ``checkpoint.tensorfile``) is copied to
storage (into a local directory inside the kernel, elsewhere in chunks; the copy, the CRC32 and the
writes release the GIL), and no collective plans the save; the manifest (kind ``"shares"``) lists each
rank's share with the names it holds. A reader picks, for the names it needs, the shares that hold them (its own
first) and reads only those files, checking each against its size and CRC32.

In a local directory, the tensor files of checkpoints that retention deletes are kept in ``.spares/``
and written over by the next uploads (see ``checkpoint.spares``); the pool holds at most one
checkpoint's worth and goes when training ends.
"""

from __future__ import annotations

import mmap
import os
import zlib
from pathlib import Path
from typing import Any

import torch

from lightning_spot.checkpoint import spares, tensorfile
from lightning_spot.checkpoint.snapshot import TENSORS, SnapshotStore, cover, share_name
from lightning_spot.checkpoint.storage import ChecksumError, Storage, join

KIND = "shares"
CHUNK = 8 * 2**20
SPARES = ".spares"
Needs = dict[str, set[str]]


def upload_share(storage: Storage, rel: str, store: SnapshotStore, step: int, rank: int) -> dict[str, Any]:
    """Copy the share of ``rank`` at ``step`` from host memory into the checkpoint ``rel``; returns the digests."""
    digests = {}
    if storage.is_local:
        storage.fs.makedirs(storage.path_of(rel), exist_ok=True)
    for suffix in (TENSORS, ".json"):
        name = share_name(rank, suffix)
        source, target = store.share_path(step, rank, suffix), storage.path_of(join(rel, name))
        if storage.is_local:
            if suffix == TENSORS:
                spares.take(Path(storage.path_of(SPARES)), Path(target), os.stat(source).st_size)
            crc, size = _copy_local(source, target)
        else:
            crc, size = _copy_chunked(source, storage, target)
        digests[name] = {"size": size, "crc32": f"{crc:08x}"}
    return digests


def _copy_chunked(source: Any, storage: Storage, target: str) -> tuple[int, int]:
    """Copy a file to any storage in chunks; (CRC32, size) computed as the bytes pass."""
    crc, size = 0, 0
    with open(source, "rb") as src, storage.fs.open(target, "wb") as dst:
        while chunk := src.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
            dst.write(chunk)
    return crc, size


def _copy_local(source: Any, target: str) -> tuple[int, int]:
    """Copy a file into a local directory inside the kernel (``sendfile``: no pass through Python buffers), over
    the target's bytes if it exists (a spare), then cut to size; the CRC32 is computed on the source mapped
    into memory (both release the GIL)."""
    with open(source, "rb") as src:
        size = os.fstat(src.fileno()).st_size
        crc = 0
        if size:
            with mmap.mmap(src.fileno(), 0, access=mmap.ACCESS_READ) as view:
                crc = zlib.crc32(view)
        dst = os.open(target, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            sent = 0
            while sent < size:
                sent += os.sendfile(dst, src.fileno(), sent, size - sent)
            os.ftruncate(dst, size)
        finally:
            os.close(dst)
    return crc, size


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
    if (len(data), f"{zlib.crc32(data):08x}") != (expected["size"], expected["crc32"]):
        raise ChecksumError(
            f"{name} fails its checksum ({len(data)} bytes, crc32 {zlib.crc32(data):08x}; expected "
            f"{expected['size']} bytes, crc32 {expected['crc32']})"
        )
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
