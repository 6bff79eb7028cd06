"""Checkpoint checksums: CRC32C (the standard check value), streamed or whole, and the zlib CRC32 records
of checkpoints written before still verified."""

from __future__ import annotations

import zlib

import pytest

from lightning_spot.checkpoint import checksum


def test_crc32c_gives_the_standard_check_value_whole_or_streamed() -> None:
    assert checksum.digest(b"123456789") == {"size": 9, "crc32c": "e3069283"}  # CRC-32C's check value
    crc = checksum.update(checksum.update(0, b"1234"), memoryview(bytearray(b"56789")))
    assert checksum.record(9, crc) == checksum.digest(b"123456789")


def test_a_mismatch_names_the_file_and_both_records() -> None:
    expected = checksum.digest(b"checkpoint bytes")
    checksum.verify(b"checkpoint bytes", expected, "a.bin")
    with pytest.raises(checksum.ChecksumError, match=r"a\.bin fails its checksum \(16 bytes, crc32c [0-9a-f]{8}"):
        checksum.verify(b"checkpoint byteZ", expected, "a.bin")
    with pytest.raises(checksum.ChecksumError, match=r"15 bytes.*expected 16 bytes"):
        checksum.verify(b"checkpoint byte", expected, "a.bin")


def test_records_of_earlier_versions_are_verified_with_zlib_crc32() -> None:
    legacy = {"size": 5, "crc32": f"{zlib.crc32(b'hello'):08x}"}
    check = checksum.Verifier(legacy)
    check.update(b"hel")
    check.update(b"lo")
    check.done("old.json")
    with pytest.raises(checksum.ChecksumError, match=r"old\.json fails its checksum \(5 bytes, crc32 "):
        checksum.verify(b"jello", legacy, "old.json")
