"""Tensor files (the safetensors layout): every dtype round-trips, files are overwritten in place, and a
damaged or foreign file is refused with its name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_spot.checkpoint import checksum, tensorfile


def _tensors() -> tensorfile.Tensors:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(5, 3, generator=g),
            "half": torch.randn(7, generator=g).bfloat16(),
            "fp16": torch.randn(3, generator=g).half(),
            "empty": torch.empty(0, 4),
            "flag": torch.tensor([True, False, True]),
        },
        "optimizer_0": {
            "state.w.step": torch.tensor(3.0),
            "count": torch.tensor(7, dtype=torch.int64),
            "f64": torch.randn(2, 2, dtype=torch.float64, generator=g),
            "u8": torch.arange(5, dtype=torch.uint8),
        },
    }


def _assert_same(got: tensorfile.Tensors, want: tensorfile.Tensors) -> None:
    assert {g: sorted(n) for g, n in got.items()} == {g: sorted(n) for g, n in want.items()}
    for group, named in want.items():
        for name, t in named.items():
            out = got[group][name]
            assert out.dtype == t.dtype and out.shape == t.shape and torch.equal(out, t), f"{group}/{name}"


def test_tensors_round_trip_through_a_file_and_through_bytes(tmp_path: Path) -> None:
    want = _tensors()
    path = tmp_path / "rank00000.safetensors"
    written = tensorfile.write_file(path, want)
    assert written == checksum.digest(path.read_bytes()), "the size and CRC32C of the bytes on disk"
    assert written["size"] == tensorfile.pack(want).size
    assert path.read_bytes() == tensorfile.encode(want)
    _assert_same(tensorfile.read_file(path, expected=written), want)
    _assert_same(tensorfile.decode(bytearray(path.read_bytes())), want)
    for named in tensorfile.read_file(path).values():  # widest first: every tensor naturally aligned
        for t in named.values():
            assert t.data_ptr() % t.element_size() == 0


def test_safetensors_opens_our_files(tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    want = _tensors()
    tensorfile.write_file(tmp_path / "share.safetensors", want)
    loaded = safetensors.load_file(str(tmp_path / "share.safetensors"))
    assert sorted(loaded) == sorted(f"{g}/{n}" for g, named in want.items() for n in named)
    assert torch.equal(loaded["model/half"], want["model"]["half"])


def test_a_file_is_overwritten_in_place_and_read_into_fresh_memory(tmp_path: Path) -> None:
    path = tmp_path / "slot.safetensors"
    tensorfile.write_file(path, {"model": {"w": torch.ones(1000)}})
    inode = path.stat().st_ino
    size = tensorfile.write_file(path, {"model": {"w": torch.full((10,), 2.0)}})["size"]
    assert path.stat().st_ino == inode and path.stat().st_size == size < 200, "the same file, cut to size"
    read = tensorfile.read_file(path)
    tensorfile.write_file(path, {"model": {"w": torch.full((10,), 3.0)}})
    assert torch.equal(read["model"]["w"], torch.full((10,), 2.0)), "what was read does not follow the file"


def test_damaged_or_foreign_files_are_refused_with_their_name(tmp_path: Path) -> None:
    path = tmp_path / "rank00001.safetensors"
    data = tensorfile.encode({"model": {"w": torch.ones(100)}})
    path.write_bytes(data[:-8])
    with pytest.raises(ValueError, match=r"rank00001.safetensors is cut short"):
        tensorfile.read_file(path)
    with pytest.raises(ValueError, match=r"share of rank 1 is cut short"):
        tensorfile.decode(bytearray(data[:-8]), "share of rank 1")
    path.write_bytes(b"PK\x03\x04 a zip file, not ours")
    with pytest.raises(ValueError, match="not a tensor file"):
        tensorfile.read_file(path)


def test_a_file_whose_bytes_changed_fails_its_recorded_checksum(tmp_path: Path) -> None:
    path = tmp_path / "rank00002.safetensors"
    written = tensorfile.write_file(path, {"model": {"w": torch.ones(100)}})
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x01  # one bit of a tensor: the file still parses
    path.write_bytes(bytes(data))
    assert torch.equal(tensorfile.read_file(path)["model"]["w"][:90], torch.ones(90)), "unchecked, it reads"
    with pytest.raises(checksum.ChecksumError, match=r"rank00002.safetensors fails its checksum"):
        tensorfile.read_file(path, expected=written)
    path.write_bytes(bytes(data) + b"tail")
    with pytest.raises(checksum.ChecksumError, match=r"bytes"):
        tensorfile.read_file(path, expected=written)
