"""In-memory snapshots on one node: each rank's share of a checkpoint kept in host memory that outlives
the worker processes (a tmpfs such as ``/dev/shm``), so that a restart resumes without reading storage.

    store = SnapshotStore.for_run(run_url, "/dev/shm/lightning-spot")
    store.write(step, rank, tensors, meta, state)   # this rank's share, whole or not at all
    staged = store.stage(step, rank, laid)          # or: a mapped spare file to copy the tensors into,
    store.write(step, rank, staged, meta, state)    #     then committed the same way
    store.prepare(rank, size)                       # in the background: a mapped spare ready for the next
    store.shares()                                  # {step: {rank: meta}} of the whole shares on this node
    tensors = store.read_tensors(step, rank); state = store.read_state(step, rank)
    store.retire([rank], keep=2)                    # older shares of these ranks: their files recycled
    store.pin(step, rank); store.unpin(step, rank)  # an upload reads the share: not recycled meanwhile
    store.prune(keep=3); store.drop_after(step); store.clear()

A share is two files, ``rankNNNNN.safetensors`` (tensors by stored name, see ``checkpoint.tensorfile``)
and ``rankNNNNN.json`` (what it holds: its names, layout and pipeline position, the tensor file's size and
CRC32C, and the JSON-ready rest: loop and data position, optimizer hyper-parameters, RNG). Each is written
to a temporary name and renamed; the JSON is renamed last, so a share exists once its JSON does and a
worker killed mid-write leaves nothing that counts. A share whose bytes fail their checksum when read is
dropped. A node may also hold shares of ranks on another node (copies that survive
that node's loss). Whether the shares of a step, across the surviving nodes, make a complete state is
decided by ``checkpoint.memory.recall``.

Retired tensor files are kept in a pool per rank (``spare/rankNNNNN/``) and overwritten by that rank's next
shares: writing into memory the tmpfs already holds costs a copy, a new file also costs the kernel
allocating and zeroing its pages. A rank's spares are mapped into its process (``checkpoint.memory.mapped``), so
that the training thread copies its state straight into the next share's file; ``prepare`` keeps one
spare mapped and ready, off the training thread.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_spot.checkpoint import tensorfile
from lightning_spot.checkpoint.checksum import ChecksumError
from lightning_spot.checkpoint.memory import spares
from lightning_spot.checkpoint.memory.mapped import FileMaps, MappedFile

#: ``ckpt_path`` of a resume from the in-memory snapshots of a step: ``snapshot://120``
SNAPSHOT_SCHEME = "snapshot://"
DEFAULT_ROOT = "/dev/shm/lightning-spot"


class SnapshotError(RuntimeError):
    """Host memory for snapshots cannot be used; the message says why and what to change."""


def default_root() -> str:
    """``/dev/shm/lightning-spot`` where the machine has a ``/dev/shm`` tmpfs, else a folder in the temp dir."""
    if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK):
        return DEFAULT_ROOT
    import tempfile

    return os.path.join(tempfile.gettempdir(), "lightning-spot-snapshots")


def share_name(rank: int, suffix: str) -> str:
    """The file name of a rank's share: ``rank00003.safetensors`` (tensors) or ``rank00003.json`` (the rest)."""
    return f"rank{rank:05d}{suffix}"


TENSORS = tensorfile.SUFFIX
SPARES_PER_RANK = 2  # retired tensor files a rank keeps to write over (more are deleted)


@dataclass(frozen=True)
class Staged:
    """A share's tensor file being filled in place: its temporary path, its mapping, the tensors viewing it."""

    path: Path
    mapped: MappedFile
    tensors: tensorfile.Tensors


def encode_tensors(obj: Any) -> bytes:
    """``torch.save`` bytes of any picklable object with tensors (what a recall sends between ranks)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def cover(
    needs: dict[str, set[str]], shares: list[tuple[int, dict[str, Any]]]
) -> tuple[list[tuple[int, dict[str, list[str]]]], list[str]]:
    """Which of ``shares`` (``(rank, names by group)``, in order of preference) provide ``needs``: the shares
    used with the names taken from each, and the names (``group/name``) that none holds."""
    remaining = {group: set(names) for group, names in needs.items()}
    used = []
    for rank, held in shares:
        take = {g: sorted(left & set(held.get(g, ()))) for g, left in remaining.items()}
        take = {g: names for g, names in take.items() if names}
        if take:
            used.append((rank, take))
            for g, names in take.items():
                remaining[g] -= set(names)
    return used, sorted(f"{g}/{n}" for g, left in remaining.items() for n in left)


class SnapshotStore:
    """The snapshots of one run on this node."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        #: the gloo process group that snapshot traffic between nodes uses (set by ``SpotCheckpoint``)
        self.group: Any = None
        self.maps = FileMaps()  # this process's spare and share files, mapped

    @classmethod
    def for_run(cls, run_url: str, root: str | None = None, part: str | None = None) -> SnapshotStore:
        """The store of run ``run_url`` on this node; ``part``: one of several process groups that train the run
        and keep snapshots apart (a torchft job's pipelines, by replica group)."""
        named = run_url.rstrip("/") + (f"#{part}" if part else "")
        key = hashlib.sha1(named.encode()).hexdigest()[:16]
        return cls(Path(root or default_root()) / key)

    @property
    def node_key(self) -> str:
        """Names this node's store among the job's (ranks with the same key read the same files)."""
        import socket

        return f"{socket.gethostname()}:{self.path}"

    def check(self, needed_bytes: int = 0) -> None:
        """Create the directory and make sure it can hold ``needed_bytes`` more; explain any failure."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / f".probe-{uuid.uuid4().hex}"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as err:
            raise SnapshotError(
                f"Cannot keep snapshots in {self.path}: {err}. Pass SpotCheckpoint(snapshot_dir=...) a writable "
                f"folder in host memory (a tmpfs such as /dev/shm), or turn snapshots off."
            ) from err
        free = shutil.disk_usage(self.path).free
        if needed_bytes and free < needed_bytes:
            raise SnapshotError(
                f"{self.path} has {free / 2**20:.0f} MiB free, but the snapshots of this node need about "
                f"{needed_bytes / 2**20:.0f} MiB (two steps, with the copies of a peer node). Enlarge the tmpfs "
                f"(e.g. docker --shm-size), pass another snapshot_dir, or turn snapshots off."
            )

    def _step_dir(self, step: int) -> Path:
        return self.path / f"step-{step:09d}"

    def share_path(self, step: int, rank: int, suffix: str) -> Path:
        return self._step_dir(step) / share_name(rank, suffix)

    def has_share(self, step: int, rank: int) -> bool:
        return self.share_path(step, rank, ".json").is_file() and self.share_path(step, rank, TENSORS).is_file()

    def read_meta(self, step: int, rank: int) -> dict[str, Any]:
        meta: dict[str, Any] = json.loads(self.share_path(step, rank, ".json").read_text())["meta"]
        return meta

    @staticmethod
    def _temporary(target: Path) -> Path:
        """Where ``target`` is written before it is renamed into place (not a share until then)."""
        return target.parent / f".{target.name}.{uuid.uuid4().hex}.tmp"

    def _write_whole(self, target: Path, data: bytes) -> None:
        tmp = self._temporary(target)
        with open(tmp, "wb") as f:
            f.write(data)
        tmp.rename(target)

    def stage(self, step: int, rank: int, laid: tensorfile.Layout) -> Staged | None:
        """A file for the share of ``rank`` at ``step``, laid out as ``laid``, to copy the tensors into: one of the
        rank's spares, mapped; ``None`` when it has none (the first shares: then write the tensors)."""
        folder = self._step_dir(step)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = self._temporary(folder / share_name(rank, TENSORS))
        if not spares.take(self._pool(rank), tmp, laid.size):
            return None
        try:
            mapped = self.maps.open(tmp, laid.size)
        except (OSError, ValueError):
            tmp.unlink(missing_ok=True)
            return None
        return Staged(tmp, mapped, mapped.views(laid))

    def prepare(self, rank: int, size: int) -> None:
        """Have a spare of ``rank`` mapped for its next share of ``size`` bytes, made if the rank has none, so
        that the next :meth:`stage` finds its pages allocated and mapped (call it off the training thread).
        Mappings of files deleted meanwhile are released. A full tmpfs makes no spare (the next share is
        then written as before)."""
        self.maps.release_deleted()
        pool = self._pool(rank)
        try:
            pool.mkdir(parents=True, exist_ok=True)
            spare = min(pool.iterdir(), default=None)
            if spare is None:
                spare = pool / f"{size:015d}-{uuid.uuid4().hex}"
                fd = os.open(spare, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError:
                    spare.unlink(missing_ok=True)
                    raise
                finally:
                    os.close(fd)
            self.maps.open(spare, size)
        except OSError:
            pass

    def write(
        self,
        step: int,
        rank: int,
        tensors: bytes | dict[str, dict[str, torch.Tensor]] | Staged,
        meta: dict[str, Any],
        state: dict[str, Any],
    ) -> int:
        """Write the share of ``rank`` at ``step`` (``tensors``: the tensors, the bytes of their file from
        :func:`tensorfile.encode`, or a file from :meth:`stage`, already filled); returns its bytes.

        ``meta`` says what the share holds (``names``, ``layout``, ``pp_rank``); ``state`` is the JSON-ready rest.
        """
        folder = self._step_dir(step)
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / share_name(rank, TENSORS)
        if isinstance(tensors, Staged):
            tmp, written = tensors.path, tensors.mapped.record()
        else:
            tmp = self._temporary(target)
            packed = tensors if isinstance(tensors, bytes) else tensorfile.pack(tensors)
            spares.take(self._pool(rank), tmp, len(packed) if isinstance(packed, bytes) else packed.size)
            try:
                written = tensorfile.write_file(tmp, packed)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        tmp.rename(target)
        size = written["size"]
        sidecar = json.dumps(
            {"meta": {**meta, "step": step, "rank": rank, "bytes": size, "tensor_file": written}, "state": state}
        )
        self._write_whole(folder / share_name(rank, ".json"), sidecar.encode())
        return size + len(sidecar)

    def _pool(self, rank: int) -> Path:
        """Where the retired tensor files of ``rank``'s shares wait to be written over."""
        return self.path / "spare" / share_name(rank, "")

    def retire(self, ranks: list[int], keep: int) -> None:
        """Retire the shares of ``ranks`` older than their newest ``keep`` (pinned ones stay): the JSON goes
        first (the share stops counting), the tensor file joins the spares; emptied step folders go."""
        for rank in ranks:
            held = sorted(self.path.glob(f"step-*/{share_name(rank, '.json')}"))
            for sidecar in held[: max(0, len(held) - keep)]:
                folder = sidecar.parent
                if (folder / f".pinned-{rank}").exists():
                    continue
                sidecar.unlink(missing_ok=True)
                spares.keep(folder / share_name(rank, TENSORS), self._pool(rank), limit=SPARES_PER_RANK)
                try:
                    folder.rmdir()
                except OSError:  # other ranks' shares are still there
                    pass

    def pin(self, step: int, rank: int) -> None:
        """Keep the share of ``rank`` at ``step`` from being retired (an upload is reading it)."""
        self._step_dir(step).mkdir(parents=True, exist_ok=True)
        (self._step_dir(step) / f".pinned-{rank}").touch()

    def unpin(self, step: int, rank: int) -> None:
        (self._step_dir(step) / f".pinned-{rank}").unlink(missing_ok=True)

    def shares(self) -> dict[int, dict[int, dict[str, Any]]]:
        """``{step: {rank: meta}}`` of every whole share on this node."""
        found: dict[int, dict[int, dict[str, Any]]] = {}
        for sidecar in sorted(self.path.glob("step-*/rank*.json")):
            try:
                meta = json.loads(sidecar.read_text())["meta"]
            except (OSError, ValueError, KeyError):
                continue
            if sidecar.with_suffix(TENSORS).is_file():
                found.setdefault(int(meta["step"]), {})[int(meta["rank"])] = meta
        return found

    def read_tensors(self, step: int, rank: int) -> dict[str, dict[str, torch.Tensor]]:
        """The share's tensors in fresh memory (its file may be recycled once training goes on), checked against
        the size and CRC32C recorded when it was written (``ChecksumError`` if they differ)."""
        expected = self.read_meta(step, rank).get("tensor_file")
        try:
            return tensorfile.read_file(self.share_path(step, rank, TENSORS), expected=expected)
        except ChecksumError as err:  # dropped, so that the next restart uses another step or storage
            self.share_path(step, rank, ".json").unlink(missing_ok=True)
            raise ChecksumError(f"{err}: the snapshot share is corrupt and was dropped") from err

    def read_state(self, step: int, rank: int) -> dict[str, Any]:
        state: dict[str, Any] = json.loads(self.share_path(step, rank, ".json").read_text())["state"]
        return state

    def prune(self, keep: int = 2) -> None:
        """Delete all but the newest ``keep`` steps, except steps with a pinned share (for leftovers that no
        rank retires: shares of ranks of an earlier layout, files of a worker killed mid-write)."""
        folders = sorted(self.path.glob("step-*"))
        for folder in folders[: max(0, len(folders) - keep)]:
            if not any(folder.glob(".pinned-*")):
                shutil.rmtree(folder, ignore_errors=True)

    def drop_after(self, step: int) -> None:
        """Delete the steps after ``step`` (a resume from ``step`` abandons them; they may be of another layout)."""
        for folder in self.path.glob("step-*"):
            if int(folder.name.split("-")[1]) > step:
                shutil.rmtree(folder, ignore_errors=True)

    def clear(self) -> None:
        self.maps.close()
        shutil.rmtree(self.path, ignore_errors=True)
