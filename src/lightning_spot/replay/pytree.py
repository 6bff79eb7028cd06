"""Batch containers that torch's pytree takes for leaves, registered so that it walks them.

    register_containers(batch)     # before the batch is cut into micro-batches (cheap once a type is known)

Loaders give dicts, tuples and lists, which torch's pytree walks; but a tokenizer's ``BatchEncoding`` (what
transformers' data collators return), another ``UserDict`` or a dataclass is a leaf to it, and a batch of them
would have no tensor to cut into micro-batches. Such a container type is registered once (its values in order,
rebuilt as the same type from them), after checking on the batch's own instance that it rebuilds; a type that
does not is left alone (and the batch is refused where its tensors are needed, as before).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch.utils._pytree as pytree

#: container types looked at already (registered or not)
_SEEN: set[type] = set()
_PLAIN = (tuple, list, dict)


def register_containers(batch: Any, depth: int = 4) -> None:
    """Register the mapping and dataclass types in ``batch`` (up to ``depth`` levels) that pytree does not walk."""
    kind = type(batch)
    if kind not in _PLAIN and kind not in _SEEN and kind not in pytree.SUPPORTED_NODES:
        _SEEN.add(kind)
        if isinstance(batch, Mapping):
            _register(batch, list(batch.keys()), lambda keys, values: kind(dict(zip(keys, values))))
        elif dataclasses.is_dataclass(batch) and all(f.init for f in dataclasses.fields(batch)):
            names = [f.name for f in dataclasses.fields(batch)]
            _register(batch, names, lambda keys, values: kind(**dict(zip(keys, values))))
    if depth > 0:
        for child in _children(batch):
            register_containers(child, depth - 1)


def _children(batch: Any) -> list:
    if isinstance(batch, (tuple, list)):  # (a long list, of strings say, holds one type: its first item tells)
        return list(batch) if len(batch) <= 16 else list(batch[:1])
    if isinstance(batch, Mapping):
        return list(batch.values())
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    return []


def _register(example: Any, keys: list, rebuild: Any) -> None:
    kind = type(example)

    def flatten(container: Any) -> tuple[list, Any]:
        names = list(container.keys()) if isinstance(container, Mapping) else keys
        return [container[k] if isinstance(container, Mapping) else getattr(container, k) for k in names], names

    def unflatten(values: Any, names: Any) -> Any:
        return rebuild(names, list(values))

    try:
        values, names = flatten(example)
        rebuilt = unflatten(values, names)
        again, again_names = flatten(rebuilt)
        if type(rebuilt) is not kind or again_names != names or any(a is not b for a, b in zip(again, values)):
            return
    except Exception:  # (a constructor that takes something else: left a leaf)
        return
    pytree.register_pytree_node(kind, flatten, unflatten, serialized_type_name=f"{kind.__module__}.{kind.__qualname__}")
