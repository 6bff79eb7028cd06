"""Checkpoint metadata is plain JSON: it round-trips Lightning's state and cannot run code when read."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch


def test_checkpoint_metadata_cannot_run_code(tmp_path: Path) -> None:
    """Loading parses DCP metadata with an allow-list: a booby-trapped .metadata is refused, not executed."""
    from lightning_spot.checkpoint.durable.shards import SafeReader, save_shards

    save_shards(str(tmp_path / "ck"), {"model": {"w": torch.ones(2)}})
    target = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self) -> tuple:
            return (Path.touch, (target,))

    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(pickle.UnpicklingError, match="refusing to load"):
        SafeReader(str(tmp_path / "ck")).read_metadata()
    assert not target.exists()


def test_json_state_round_trip() -> None:
    from lightning_spot.checkpoint.jsonstate import decode, encode

    state = {
        "t": torch.arange(6, dtype=torch.float64).reshape(2, 3),
        "bf": torch.tensor([1.5], dtype=torch.bfloat16),
        "tuple": (0.9, 0.999),
        3: float("inf"),
        "__reserved": {"\\x": None},
        "empty": torch.empty(0),
    }
    back = decode(json.loads(json.dumps(encode(state))))
    assert torch.equal(back["t"], state["t"]) and back["t"].dtype == torch.float64
    assert torch.equal(back["bf"], state["bf"]) and back["tuple"] == (0.9, 0.999)
    assert back[3] == float("inf") and back["__reserved"] == {"\\x": None} and back["empty"].numel() == 0
    with pytest.raises(TypeError, match="state.bad"):
        encode({"bad": object()})
