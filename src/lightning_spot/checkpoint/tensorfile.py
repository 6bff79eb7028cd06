"""Named tensors in one file of raw bytes (the safetensors layout), written and read without serialising.

    written = write_file(path, tensors)   # {group: {name: tensor}} -> bytes on disk, one vectored write;
                                          # returns the file's {"size", "crc32c"} (see checkpoint.checksum)
    packed = pack(tensors); packed.size; write_file(path, packed)   # the size known before writing
    tensors = read_file(path, expected=written)   # fresh tensors, one vectored read, checked if given
    data = encode(tensors); tensors = decode(bytearray(data))   # the same bytes in memory (network copies)
    laid = layout(tensors); into = views(buffer, laid)   # tensors viewing a buffer (a mapped file) to copy into

The layout is safetensors' (an 8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and byte range, then the bytes), so ``safetensors.torch.load_file`` opens our files too;
keys are ``group/name``. Tensors are stored widest element first, so that each one lies at an offset
that is a multiple of its element size. Writing is a vectored ``pwritev`` of the tensors' own memory:
no pickling, no intermediate copy, the GIL released; into a file that already exists (a recycled
snapshot file in a tmpfs) it costs a memory copy (~1.5 ms for 12.5 MB, against ~8 ms for ``torch.save``).
"""

from __future__ import annotations

import functools
import json
import math
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_spot.checkpoint import checksum

SUFFIX = ".safetensors"
Tensors = dict[str, dict[str, torch.Tensor]]

_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}
_CHUNK = 1 << 30  # bytes per system call: Linux moves at most ~2 GiB per read or write
_IOV_MAX = 1024  # buffers per system call


def _code(dtype: torch.dtype) -> str:
    """safetensors' name of a dtype; dtypes it lacks are kept under torch's name (our reader takes both)."""
    return _CODES.get(dtype, str(dtype).removeprefix("torch."))


def _dtype(code: str) -> torch.dtype:
    dtype = _DTYPES.get(code) or getattr(torch, code, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {code!r} in a tensor file")
    return dtype


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a file lies: the file's first bytes (length + header), each tensor's key
    (``group``, ``name``), dtype, shape and byte range from the start of the file, in file order, and the
    file's size."""

    head: bytes
    entries: tuple[tuple[str, str, torch.dtype, tuple[int, ...], int, int], ...]
    size: int


@dataclass(frozen=True)
class Packed:
    """A file about to be written: its first bytes (length + header), the tensors in the order their bytes
    follow, and its size."""

    head: bytes
    tensors: list[torch.Tensor]
    size: int


def _ordered(tensors: Tensors) -> list[tuple[str, str, torch.Tensor]]:
    items = [(group, name, t) for group, named in tensors.items() for name, t in named.items()]
    items.sort(key=lambda item: -item[2].element_size())  # widest first: every tensor naturally aligned
    return items


def layout(tensors: Tensors) -> Layout:
    """Lay ``tensors`` out for a file from their dtypes and shapes only (nothing is read or copied; the same
    names, dtypes and shapes give the same, cached, layout)."""
    return _layout(tuple((group, name, t.dtype, tuple(t.shape)) for group, name, t in _ordered(tensors)))


@functools.lru_cache(maxsize=16)
def _layout(items: tuple[tuple[str, str, torch.dtype, tuple[int, ...]], ...]) -> Layout:
    header: dict[str, Any] = {"__metadata__": {"format": "lightning-spot"}}
    offset = 0
    spans = []
    for group, name, dtype, shape in items:
        size = math.prod(shape) * dtype.itemsize
        header[f"{group}/{name}"] = {
            "dtype": _code(dtype),
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        spans.append((group, name, dtype, shape, offset, size))
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the bytes start at a multiple of 8
    start = 8 + len(text)
    return Layout(
        struct.pack("<Q", len(text)) + text,
        tuple((g, n, dtype, shape, start + begin, start + begin + size) for g, n, dtype, shape, begin, size in spans),
        start + offset,
    )


def pack(tensors: Tensors) -> Packed:
    """Lay ``tensors`` out for a file (no bytes copied)."""
    laid = layout(tensors)
    return Packed(laid.head, [t.detach().cpu().contiguous() for _, _, t in _ordered(tensors)], laid.size)


def views(buffer: Any, laid: Layout) -> Tensors:
    """Tensors viewing a writable ``buffer`` of ``laid.size`` bytes where ``laid`` puts them: copying into them
    fills the file's bytes. Writes the file's first bytes."""
    view = memoryview(buffer).cast("B")
    view[: len(laid.head)] = laid.head
    out: Tensors = {}
    for group, name, dtype, shape, begin, end in laid.entries:
        if end > begin:
            t = torch.frombuffer(view, dtype=torch.uint8, count=end - begin, offset=begin).view(dtype)
        else:
            t = torch.empty(0, dtype=dtype)
        out.setdefault(group, {})[name] = t.reshape(shape)
    return out


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    array: Any = t.reshape(-1).view(torch.uint8).numpy()  # numpy arrays export the buffer protocol
    return memoryview(array).cast("B")


def _chunks(buffers: Iterable[memoryview]) -> Iterable[memoryview]:
    for b in buffers:
        for start in range(0, len(b), _CHUNK):
            yield b[start : start + _CHUNK]


def _vectored(call: Any, fd: int, buffers: list[memoryview], offset: int) -> None:
    """``os.pwritev``/``os.preadv`` every byte of ``buffers`` from ``offset``, resuming after short transfers."""
    pending = [b for b in _chunks(buffers) if len(b)]
    first = 0  # pending[first:] is still to move (an index, not pop(0): ranks hold thousands of tensors)
    while first < len(pending):
        done = call(fd, pending[first : first + _IOV_MAX], offset)
        if done <= 0:
            left = sum(map(len, pending[first:]))
            raise OSError(f"tensor file transfer stopped at byte {offset} (of {offset + left})")
        offset += done
        while done:
            if done >= len(pending[first]):
                done -= len(pending[first])
                first += 1
            else:
                pending[first], done = pending[first][done:], 0


def write_file(path: str | Path, tensors: Tensors | Packed | bytes) -> dict[str, Any]:
    """Write ``tensors`` (or their :func:`pack`, or the bytes of :func:`encode`) into ``path``; an existing file
    is overwritten in place and cut to size. Returns the file's size and CRC32C (``checksum.record``)."""
    if isinstance(tensors, bytes):
        buffers, size = [memoryview(tensors)], len(tensors)
    else:
        packed = tensors if isinstance(tensors, Packed) else pack(tensors)
        buffers, size = [memoryview(packed.head), *(_raw(t) for t in packed.tensors)], packed.size
    crc = 0
    for b in buffers:
        crc = checksum.update(crc, b)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        _vectored(os.pwritev, fd, buffers, 0)
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    return checksum.record(size, crc)


def encode(tensors: Tensors) -> bytes:
    """The bytes :func:`write_file` would write."""
    packed = pack(tensors)
    return b"".join([packed.head, *(_raw(t).tobytes() for t in packed.tensors)])


def _entries(header: dict[str, Any]) -> Iterable[tuple[str, str, torch.dtype, list[int], int, int]]:
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        group, _, name = key.partition("/")
        begin, end = entry["data_offsets"]
        yield group, name, _dtype(entry["dtype"]), entry["shape"], begin, end


def _header_length(first: bytes | memoryview) -> int:
    """The header length a file's first 8 bytes give (0 if there are fewer: refused by :func:`_header`)."""
    return int(struct.unpack("<Q", first[:8])[0]) if len(first) >= 8 else 0


def _header(prefix: bytes | memoryview, where: str) -> tuple[dict[str, Any], int]:
    """The JSON header at the start of ``prefix`` and where the tensors' bytes begin."""
    if len(prefix) < 8:
        raise ValueError(f"{where} is not a tensor file (too short)")
    length = _header_length(prefix)
    if length > len(prefix) - 8:
        raise ValueError(f"{where} is not a tensor file, or is cut short (header of {length} bytes)")
    try:
        header: dict[str, Any] = json.loads(bytes(prefix[8 : 8 + length]))
    except ValueError as err:
        raise ValueError(f"{where} is not a tensor file: {err}") from err
    return header, 8 + length


def decode(data: bytearray | memoryview, where: str = "tensor bytes") -> Tensors:
    """Tensors viewing ``data`` (writable bytes of an :func:`encode`\\ d file; they keep it alive)."""
    view = memoryview(data).cast("B")
    header, start = _header(view, where)
    out: Tensors = {}
    for group, name, dtype, shape, begin, end in _entries(header):
        if start + end > len(view):
            raise ValueError(f"{where} is cut short: {group}/{name} ends at byte {start + end} of {len(view)}")
        raw = (
            torch.frombuffer(view, dtype=torch.uint8, count=end - begin, offset=start + begin) if end > begin else None
        )
        t = raw.view(dtype) if raw is not None else torch.empty(0, dtype=dtype)
        out.setdefault(group, {})[name] = t.reshape(shape)
    return out


def read_file(path: str | Path, expected: dict[str, Any] | None = None) -> Tensors:
    """The tensors of a file, read into fresh memory (a later overwrite of the file cannot reach them); with
    ``expected`` (what :func:`write_file` returned), a file whose bytes differ raises ``ChecksumError``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        length = _header_length(os.pread(fd, 8, 0))
        prefix = os.pread(fd, 8 + min(length, size), 0)
        header, start = _header(prefix, str(path))
        out: Tensors = {}
        buffers, filled = [], 0
        for group, name, dtype, shape, begin, end in sorted(_entries(header), key=lambda e: e[4]):
            t = torch.empty(shape, dtype=dtype)
            out.setdefault(group, {})[name] = t
            if end > begin:
                if begin != filled:  # one read fills the tensors in order: the bytes must follow each other
                    raise ValueError(f"{path} has a gap or an overlap before {group}/{name} (byte {begin})")
                buffers.append(_raw(t))
                filled = end
        if start + filled > size:
            raise ValueError(f"{path} is cut short: {size} bytes, its tensors need {start + filled}")
        _vectored(os.preadv, fd, buffers, start)
    finally:
        os.close(fd)
    if expected is not None:
        check = checksum.Verifier(expected)
        for b in (memoryview(prefix), *buffers):
            check.update(b)
        check.done(str(path))
    return out
