"""Entries of a Lightning checkpoint that hold a second copy of the model's state, kept like the model.

Lightning's ``WeightAveraging`` callbacks (``EMAWeightAveraging``) put the averaged weights in ``state_dict`` and
the weights being trained in ``current_model_state``; ``StochasticWeightAveraging`` keeps its average in its
callback state (``average_model_state``); a model's own ``on_save_checkpoint`` may do the same
(``checkpoint["ema"] = {name: tensor, ...}`` under the names of ``state_dict``). On a pipeline such an entry holds
this rank's stages only, and is as large as they are: it cannot go to the manifest (JSON, from one rank). It is
stored like the model instead (a tensor group of its own, under stored names, read back by name onto any layout),
and the manifest keeps a mark in its place. An entry is found by its path of keys, at any depth of dicts.

    copies = find(checkpoint, model, stored)                 # path -> {stored name: tensor}
    encoded = encode(with_marks(checkpoint, copies))         # the manifest's part, marks in place
    paths = marked(lightning)                                # (loading) the paths a checkpoint's manifest marks
    tensors |= targets(model_target, paths)                  # what to read them into
    fill(checkpoint, module.state_dict(), tensors, stored_name)  # marks -> this rank's tensors, its own names
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from lightning_spot.checkpoint.jsonstate import Encoded

#: the manifest's value for an entry stored as a model copy
MARK = "__model_copy__"
#: the tensor groups of copies start with this
PREFIX = "copy:"
#: keys Lightning itself fills with tensors: never copies
_OWN = frozenset({"state_dict", "optimizer_states"})
#: how deep in nested dicts copies are looked for (a callback's state is at depth 3)
_DEPTH = 4

Path = tuple[str, ...]


def group_of(path: Path) -> str:
    """The tensor group of the copy at ``path`` (a digest: keys hold any character, group names no ``/``)."""
    return PREFIX + hashlib.sha1(json.dumps(list(path)).encode()).hexdigest()[:16]


def groups_in(tensors: dict[str, dict[str, Tensor]]) -> dict[str, dict[str, Tensor]]:
    """The copies' groups among a rank's tensors (by group)."""
    return {group: named for group, named in tensors.items() if group.startswith(PREFIX)}


def _dicts(tree: dict[str, Any], path: Path = ()) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every dict value under ``tree`` with string keys (not Lightning's own tensors), with its path."""
    for key, value in tree.items():
        if not isinstance(key, str) or not isinstance(value, dict) or (not path and key in _OWN):
            continue
        yield (*path, key), value
        if len(path) + 1 < _DEPTH:
            yield from _dicts(value, (*path, key))


def find(
    checkpoint: dict[str, Any], model: dict[str, Tensor], stored: Callable[[dict[str, Any]], dict[str, Any]]
) -> dict[Path, dict[str, Tensor]]:
    """The entries of ``checkpoint`` that are dicts of tensors with exactly the names of ``model`` (this rank's
    state under stored names; ``stored`` maps a dict's names the same way), under stored names, by path."""
    names = set(model)
    found = {}
    for path, value in _dicts(checkpoint):
        if value and all(isinstance(name, str) and isinstance(t, Tensor) for name, t in value.items()):
            named = stored(value)
            if set(named) == names:
                found[path] = named
    return found


def mark() -> dict[str, Any]:
    """What the manifest holds in place of a copy (its JSON form: not the encoding of any stored value)."""
    return {MARK: True}


def with_marks(checkpoint: dict[str, Any], paths: Iterable[Path]) -> dict[str, Any]:
    """``checkpoint`` with a mark (kept as it is by ``jsonstate.encode``) at each path; the dicts on the way are
    copied, ``checkpoint`` is unchanged."""
    out = dict(checkpoint)
    for path in paths:
        node = out
        for key in path[:-1]:
            node[key] = dict(node[key])
            node = node[key]
        node[path[-1]] = Encoded(mark())
    return out


def _is_mark(value: Any) -> bool:
    return isinstance(value, dict) and len(value) == 1 and value.get(MARK) is True


def marked(lightning: dict[str, Any]) -> list[Path]:
    """The paths in a checkpoint's Lightning part (encoded or decoded) that stand for model copies."""
    return [path for path, value in _dicts(lightning) if _is_mark(value)]


def targets(model_target: dict[str, Tensor], paths: Iterable[Path]) -> dict[str, dict[str, Tensor]]:
    """Empty tensors to read each copy into: this rank's model names (stored), shaped like its tensors."""
    return {group_of(path): {name: torch.empty_like(t) for name, t in model_target.items()} for path in paths}


def fill(
    checkpoint: dict[str, Any],
    local_state: dict[str, Tensor],
    tensors: dict[str, dict[str, Tensor]],
    stored_name: Callable[[str], str],
) -> None:
    """Replace the marks in a restored ``checkpoint`` by this rank's copies under its own names (``local_state``:
    the module's ``state_dict()``, loaded already); ``state_dict`` is set to that state too, as in a checkpoint
    Lightning wrote (``WeightAveraging`` reads its average there)."""
    paths = marked(checkpoint)
    if not paths:
        return
    missing = [path for path in paths if group_of(path) not in tensors]
    if missing:
        raise RuntimeError(
            f"the checkpoint marks {missing} as copies of the model's state, but their tensors were not read"
        )
    checkpoint["state_dict"] = dict(local_state)
    for path in paths:
        copy = tensors[group_of(path)]
        node = checkpoint
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = {name: copy[stored_name(name)] for name in local_state}
