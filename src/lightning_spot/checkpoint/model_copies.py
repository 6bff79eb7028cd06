"""Entries of a Lightning checkpoint that hold a second copy of the model's state, kept like the model.

Lightning's ``WeightAveraging`` callbacks (``EMAWeightAveraging``) put the averaged weights in ``state_dict`` and
the weights being trained in ``current_model_state``; a model's own ``on_save_checkpoint`` may do the same
(``checkpoint["ema"] = {name: tensor, ...}`` under the names of ``state_dict``). On a pipeline such an entry holds
this rank's stages only, and is as large as they are: it cannot go to the manifest (JSON, from one rank). It is
stored like the model instead (the tensor group ``copy:<key>``, under stored names, read back by name onto any
layout), and the manifest keeps a mark in its place.

    copies = find(checkpoint, model, stored)                 # key -> {stored name: tensor}
    keys = marked(lightning)                                 # (loading) the keys a checkpoint's manifest marks
    tensors |= targets(model_target, keys)                   # what to read them into
    fill(checkpoint, module.state_dict(), tensors, stored_name)  # marks -> this rank's tensors, its own names
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

#: the manifest's value for an entry stored as a model copy
MARK = "__model_copy__"
#: the tensor group of entry ``key`` is ``PREFIX + key``
PREFIX = "copy:"
#: keys Lightning itself fills with tensors: never copies
_OWN = frozenset({"state_dict", "optimizer_states"})


def group_of(key: str) -> str:
    return PREFIX + key


def groups_in(tensors: dict[str, dict[str, Tensor]]) -> dict[str, dict[str, Tensor]]:
    """The copies' groups among a rank's tensors (by group)."""
    return {group: named for group, named in tensors.items() if group.startswith(PREFIX)}


def find(
    checkpoint: dict[str, Any], model: dict[str, Tensor], stored: Callable[[dict[str, Any]], dict[str, Any]]
) -> dict[str, dict[str, Tensor]]:
    """The entries of ``checkpoint`` that are dicts of tensors with exactly the names of ``model`` (this rank's
    state under stored names; ``stored`` maps a dict's names the same way), under stored names."""
    names = set(model)
    found = {}
    for key, value in checkpoint.items():
        if key in _OWN or not isinstance(value, dict) or not value:
            continue
        if all(isinstance(name, str) and isinstance(t, Tensor) for name, t in value.items()):
            named = stored(value)
            if set(named) == names:
                found[key] = named
    return found


def mark() -> dict[str, Any]:
    """What the manifest holds in place of a copy (its JSON form: not the encoding of any stored value)."""
    return {MARK: True}


def marked(lightning: dict[str, Any]) -> list[str]:
    """The keys of a checkpoint's Lightning part (encoded or decoded) that stand for model copies."""
    return [key for key, value in lightning.items() if isinstance(value, dict) and value.get(MARK) is True]


def targets(model_target: dict[str, Tensor], keys: Iterable[str]) -> dict[str, dict[str, Tensor]]:
    """Empty tensors to read each copy into: this rank's model names (stored), shaped like its tensors."""
    return {group_of(key): {name: torch.empty_like(t) for name, t in model_target.items()} for key in keys}


def fill(
    checkpoint: dict[str, Any],
    local_state: dict[str, Tensor],
    tensors: dict[str, dict[str, Tensor]],
    stored_name: Callable[[str], str],
) -> None:
    """Replace the marks in a restored ``checkpoint`` by this rank's copies under its own names (``local_state``:
    the module's ``state_dict()``, loaded already); ``state_dict`` is set to that state too, as in a checkpoint
    Lightning wrote (``WeightAveraging`` reads its average there)."""
    keys = marked(checkpoint)
    if not keys:
        return
    missing = [key for key in keys if group_of(key) not in tensors]
    if missing:
        raise RuntimeError(
            f"the checkpoint marks {missing} as copies of the model's state, but their tensors were not read"
        )
    checkpoint["state_dict"] = dict(local_state)
    for key in keys:
        copy = tensors[group_of(key)]
        checkpoint[key] = {name: copy[stored_name(name)] for name in local_state}
