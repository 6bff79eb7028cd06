"""Tensor shards through ``torch.distributed.checkpoint`` on any fsspec URL, checksummed, read without pickle.

    digests = save_shards(url, {"model": sd, "optimizer_0": flat}, storage_options)   # collective
    load_shards(url, {"model": target_sd, ...}, storage_options)                       # collective, any layout

Writing records the size and CRC32C of every file this rank writes (for the manifest); reading
checks them as the bytes arrive. Reading parses DCP's ``.metadata`` with an allow-list unpickler
(only DCP's own metadata classes) and the tensor files with ``torch.load(weights_only=True)``, so
a checkpoint cannot run code on load.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecReader, FsspecWriter
from torch.distributed.checkpoint.metadata import StorageMeta

from lightning_spot.checkpoint import checksum

Digests = dict[str, dict[str, Any]]


def _inner_fs(wrapper: Any) -> Any:
    """The fsspec filesystem inside torch's ``FsspecWriter`` / ``FsspecReader`` file-system wrapper."""
    return wrapper.fs


class _HashingStream:
    """A write-only stream wrapper that counts bytes and computes a running checksum."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.size = 0
        self.crc = 0

    def write(self, data: Any) -> Any:
        view = memoryview(data)
        self.crc = checksum.update(self.crc, view)
        self.size += view.nbytes
        return self._inner.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _HashingFileSystem(FileSystem):
    def __init__(self, fs: Any, digests: Digests) -> None:
        super().__init__()
        self.fs = fs
        self.digests = digests

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as stream:
            hashing = _HashingStream(stream)
            yield hashing
        name = os.path.basename(os.fspath(path)).removesuffix(".tmp")
        self.digests[name] = checksum.record(hashing.size, hashing.crc)


class ChecksummingWriter(FsspecWriter):
    """``FsspecWriter`` that records ``{file: {size, crc32c}}`` for what this rank writes."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, thread_count: int = 1) -> None:
        super().__init__(url, sync_files=False, thread_count=thread_count, **(storage_options or {}))
        self.digests: Digests = {}
        # torch types ``fs`` as its local FileSystem; at run time it is the fsspec one this wraps
        self.fs = _HashingFileSystem(_inner_fs(self.fs), self.digests)  # type: ignore[assignment]


_ALLOWED_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint._extension",
)
_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch", "device"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata only: its dataclasses, torch dtypes/sizes and plain containers."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _ALLOWED_MODULES or (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"refusing to load {module}.{name} from checkpoint metadata: only torch.distributed.checkpoint "
            f"metadata is accepted"
        )


class _VerifyingFileSystem(FileSystem):
    """Reads each listed file once into a spool while computing its CRC32C; refuses mismatches."""

    def __init__(self, fs: Any, expected: Digests) -> None:
        super().__init__()
        self.fs = fs
        self.expected = expected

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        name = os.path.basename(os.fspath(path))
        if "r" not in mode or name not in self.expected:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        if isinstance(self.fs, LocalFileSystem):  # verify in one streaming pass, then read it again (page cache)
            with super().create_stream(path, mode) as stream:
                self._check(name, stream, None)
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        # remote: download once, verifying as the bytes arrive; spill to local disk beyond 1 GiB
        with super().create_stream(path, mode) as stream, tempfile.SpooledTemporaryFile(max_size=2**30) as spool:
            self._check(name, stream, spool)
            spool.seek(0)
            yield spool

    def _check(self, name: str, stream: Any, copy_to: Any) -> None:
        check = checksum.Verifier(self.expected[name])
        while block := stream.read(1 << 22):
            check.update(block)
            if copy_to is not None:
                copy_to.write(block)
        check.done(name)


class SafeReader(FsspecReader):
    """``FsspecReader`` whose metadata parsing cannot execute arbitrary code.

    With ``expected`` (the manifest's file digests), every file is checked as it is read, so
    verification costs no extra pass over the data.
    """

    def __init__(
        self, url: str, storage_options: dict[str, Any] | None = None, expected: Digests | None = None
    ) -> None:
        super().__init__(url, **(storage_options or {}))
        self._metadata_cache: dict[Any, Any] = {}
        if expected is not None:
            self.fs = _VerifyingFileSystem(_inner_fs(self.fs), expected)  # type: ignore[assignment]

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        cached = self._metadata_cache.get(kwargs.get("rank"))
        if cached is not None:
            return cached
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        self._metadata_cache[kwargs.get("rank")] = metadata
        return metadata


def save_shards(
    url: str,
    state: dict[str, Any],
    storage_options: dict[str, Any] | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
    thread_count: int = 1,
) -> Digests:
    """Write ``state`` (nested dicts of tensors keyed by name) as DCP shards under ``url``; collective."""
    writer = ChecksummingWriter(url, storage_options, thread_count=thread_count)
    dcp.save(state, storage_writer=writer, process_group=process_group)
    return writer.digests


def load_shards(
    url: str,
    state: dict[str, Any],
    storage_options: dict[str, Any] | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
    expected: Digests | None = None,
) -> None:
    """Fill ``state``'s tensors in place from the shards under ``url``; resharded by key; collective.

    With ``expected``, each file read is verified against its recorded size and CRC32C.
    """
    dcp.load(state, storage_reader=SafeReader(url, storage_options, expected), process_group=process_group)


__all__ = ["ChecksummingWriter", "Digests", "SafeReader", "load_shards", "save_shards"]
