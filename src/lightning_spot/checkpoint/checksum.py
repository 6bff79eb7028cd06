"""Checksums of checkpoint files: CRC32C, computed by the CPU's own instruction where it has one.

    digest(data)                         # {"size": 12, "crc32c": "1c291ca3"}, as manifests record files
    crc = update(0, block); crc = update(crc, block2); record(size, crc)   # streamed
    verify(data, expected, "rank00000.safetensors")                        # ChecksumError if not
    check = Verifier(expected); check.update(block); ...; check.done(name)  # streamed

CRC32C (the checksum S3 also offers) runs at ~15 GB/s with SSE4.2/ARMv8 CRC instructions against
~3 GB/s for ``zlib.crc32``, releases the GIL and reads any buffer without a copy (``crc32c`` package).
Checkpoints that earlier versions wrote record ``"crc32"`` (zlib) and are still verified with it.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

from crc32c import crc32c as _crc32c

KEY = "crc32c"
_LEGACY = "crc32"


class ChecksumError(ValueError):
    """A checkpoint file's bytes do not match the size and checksum recorded for it."""


def update(crc: int, data: Any) -> int:
    """The CRC32C of the bytes behind ``crc`` followed by ``data`` (any contiguous buffer)."""
    return int(_crc32c(data, crc))


def record(size: int, crc: int) -> dict[str, Any]:
    """What a manifest records of a file."""
    return {"size": size, KEY: f"{crc:08x}"}


def digest(data: Any) -> dict[str, Any]:
    """The record of ``data``'s bytes."""
    return record(memoryview(data).nbytes, update(0, data))


class Verifier:
    """Checks bytes streamed through it against a file's record (either checksum)."""

    def __init__(self, expected: dict[str, Any]) -> None:
        self.expected = expected
        self.key = KEY if KEY in expected else _LEGACY
        self._fn: Callable[[int, Any], int] = update if self.key == KEY else lambda crc, b: zlib.crc32(b, crc)
        self.crc = 0
        self.size = 0

    def update(self, data: Any) -> None:
        self.crc = self._fn(self.crc, data)
        self.size += memoryview(data).nbytes

    def done(self, name: str) -> None:
        """Raise :class:`ChecksumError` naming ``name`` unless every byte of the file passed and matched."""
        got, want = (self.size, f"{self.crc:08x}"), (self.expected.get("size"), self.expected.get(self.key))
        if got != want:
            raise ChecksumError(
                f"{name} fails its checksum ({got[0]} bytes, {self.key} {got[1]}; expected {want[0]} bytes, "
                f"{self.key} {want[1]})"
            )


def verify(data: Any, expected: dict[str, Any], name: str) -> None:
    """Raise :class:`ChecksumError` naming ``name`` unless ``data`` matches its record."""
    check = Verifier(expected)
    check.update(data)
    check.done(name)
