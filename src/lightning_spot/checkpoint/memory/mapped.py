"""Snapshot tensor files mapped into this process, so that copying a rank's state fills them in place.

    maps = FileMaps()
    mapped = maps.open(path, size)     # the file (cut or grown to ``size``) mapped read-write, by inode
    into = mapped.views(laid)          # tensors at a tensorfile.Layout's offsets (cached); copy_ into them
    record = mapped.record()           # the size and CRC32C of the file's bytes (the GIL released)
    maps.release_deleted(); maps.close()

A file in a tmpfs is memory. Mapping it lets the training thread's copy of the state (needed anyway:
training goes on while the snapshot is kept) land in the snapshot file itself, instead of in a staging
buffer that a background thread then writes into the file: one copy of every byte instead of two (the
second cost ~1.5 ms of CPU per 12.5 MB on a quiet machine, ~5 ms on a busy one). A mapping follows its
file through renames (step folder, spare pool), so a rank's few snapshot files are mapped once and their
page tables stay warm; a mapping of a file that was deleted keeps its memory until it is released.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

from lightning_spot.checkpoint import checksum, tensorfile

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # fault every page in at once (Linux), not one by one later


class MappedFile:
    """One file mapped read-write, and the tensors viewing it for the layout it was last filled with."""

    def __init__(self, fd: int, size: int, key: tuple[int, int]) -> None:
        self.fd = fd
        self.key = key
        self.buffer = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
        self._views: tuple[bytes, tensorfile.Tensors] | None = None

    @property
    def size(self) -> int:
        return len(self.buffer)

    def views(self, laid: tensorfile.Layout) -> tensorfile.Tensors:
        """Tensors viewing this file where ``laid`` puts them; the file's first bytes are (re)written."""
        if self._views is not None and self._views[0] == laid.head:
            self.buffer[: len(laid.head)] = laid.head  # whoever had the file before may have written there
            return self._views[1]
        into = tensorfile.views(self.buffer, laid)
        self._views = (laid.head, into)
        return into

    def record(self) -> dict[str, Any]:
        """What a manifest records of the file's bytes (``checksum.record``)."""
        return checksum.digest(self.buffer)

    def deleted(self) -> bool:
        return os.fstat(self.fd).st_nlink == 0

    def close(self) -> None:
        self._views = None
        try:
            self.buffer.close()
        except BufferError:  # tensors viewing it are still alive: the memory goes with the last of them
            pass
        os.close(self.fd)


class FileMaps:
    """This process's mappings of its snapshot files, by inode (at most ``limit``; the oldest go first)."""

    def __init__(self, limit: int = 8) -> None:
        self.limit = limit
        self._maps: dict[tuple[int, int], MappedFile] = {}

    def open(self, path: str | Path, size: int) -> MappedFile:
        """``path`` mapped read-write with ``size`` bytes (the file cut or grown to that size first)."""
        fd = os.open(path, os.O_RDWR)
        try:
            stat = os.fstat(fd)
            key = (stat.st_dev, stat.st_ino)
            found = self._maps.get(key)
            if found is not None and found.size == size == stat.st_size:
                os.close(fd)
                return found
            if found is not None:
                del self._maps[key]
                found.close()
            if stat.st_size != size:
                os.ftruncate(fd, size)
                if size > stat.st_size:  # allocate the new pages now: a full tmpfs fails here, not in a copy
                    os.posix_fallocate(fd, 0, size)
            mapped = MappedFile(fd, size, key)
        except BaseException:
            os.close(fd)
            raise
        self._maps[key] = mapped
        while len(self._maps) > self.limit:
            self._maps.pop(next(iter(self._maps))).close()
        return mapped

    def release_deleted(self) -> None:
        """Unmap files that no longer exist under any name (their memory is freed)."""
        for key, mapped in list(self._maps.items()):
            if mapped.deleted():
                del self._maps[key]
                mapped.close()

    def close(self) -> None:
        for mapped in self._maps.values():
            mapped.close()
        self._maps.clear()
