"""Lossless JSON for training state (no pickle): tensors, tuples, int keys and floats survive.

text = json.dumps(encode(state));  state == decode(json.loads(text))
"""

from __future__ import annotations

import base64
import enum
import math
from pathlib import PurePath
from typing import Any

import torch

MAX_TENSOR_ELEMENTS = 1 << 16


class Encoded:
    """A value already in its JSON form: :func:`encode` keeps it as it is (a mark that no stored value encodes to)."""

    def __init__(self, value: Any) -> None:
        self.value = value


def encode(obj: Any, where: str = "state") -> Any:
    """A JSON-compatible form of ``obj``; raises ``TypeError`` naming the offending entry."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, Encoded):
        return obj.value
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"__float__": repr(obj)}
    if isinstance(obj, torch.Tensor):
        if obj.numel() > MAX_TENSOR_ELEMENTS:
            raise TypeError(f"{where} is a tensor of {obj.numel()} elements; large tensors belong in the shards")
        t = obj.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {
            "__tensor__": base64.b64encode(raw).decode(),
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
        }
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {("\\" + k if k.startswith(("__", "\\")) else k): encode(v, f"{where}.{k}") for k, v in obj.items()}
        return {"__items__": [[encode(k, f"{where}[key]"), encode(v, f"{where}[{k!r}]")] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": _encode_items(obj, where)}
    if isinstance(obj, (list, set, frozenset)):
        return _encode_items(obj, where)
    if isinstance(obj, enum.Enum):
        return encode(obj.value, where)
    if isinstance(obj, PurePath):
        return str(obj)
    if type(obj).__module__ == "numpy":  # numpy arrays and scalars
        return encode(obj.tolist(), where)
    raise TypeError(f"{where} ({type(obj).__name__}) cannot be stored in a lightning-spot checkpoint manifest")


def _encode_items(items: Any, where: str) -> list[Any]:
    values = list(items)
    if all(type(v) is int or type(v) is str for v in values):  # e.g. a random generator's state: no recursion
        return values
    return [encode(v, f"{where}[{i}]") for i, v in enumerate(values)]


def decode(obj: Any) -> Any:
    """Inverse of :func:`encode`."""
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        dtype = getattr(torch, obj["dtype"])
        raw = base64.b64decode(obj["__tensor__"]) if obj["__tensor__"] else b""
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(obj["shape"]).clone()
    if "__float__" in obj:
        return float(obj["__float__"])
    if "__tuple__" in obj:
        return tuple(decode(v) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {decode(k): decode(v) for k, v in obj["__items__"]}
    return {(k[1:] if k.startswith("\\") else k): decode(v) for k, v in obj.items()}
