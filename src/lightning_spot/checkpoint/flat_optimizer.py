"""Optimizer state keyed by parameter name (torch's flattened form), out of an optimizer and back into one.

    flat = optimizer_state(module, optimizer)          # {"state.layers.0.weight.exp_avg": tensor, "param_groups.…": …}
    load_optimizer_state(module, optimizer, tensors, values, aliases)   # the same keys, stored names

Names make the state readable by any layout: a stage holds the names of its own parameters, whatever the cuts.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from lightning_spot.checkpoint.payload import stored_name

FLAT_OPTIMIZER_STATE = StateDictOptions(flatten_optimizer_state_dict=True)


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state keyed by parameter name (flattened): readable by any layout.

    The names are torch's (``get_optimizer_state_dict``, which the first call of each optimizer uses); later
    calls flatten ``optimizer.state_dict()`` with the names it gave, as long as the parameters are the same
    and every one has plain state (torch's own call checks the model's structure every time: ~1 ms per save).
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    names = _NAMES.get(optimizer)
    if names is not None and names[0] == [id(p) for p in params] and _plain_state(optimizer, params):
        return _flatten(optimizer.state_dict(), names[1])
    flat = get_optimizer_state_dict(module, optimizer, options=FLAT_OPTIMIZER_STATE)
    found = _names_of(flat, optimizer)
    if found is not None:
        _NAMES[optimizer] = ([id(p) for p in params], found)
    return flat


#: per optimizer: the ids of its parameters and the name torch gave each (in the same order)
_NAMES: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[list[int], list[str]]] = weakref.WeakKeyDictionary()


def _plain_state(optimizer: torch.optim.Optimizer, params: list[Tensor]) -> bool:
    """Every parameter has state, of tensors and numbers only (what the fast path flattens as torch does)."""
    state = optimizer.state
    return all(
        p in state and state[p] and all(isinstance(v, (Tensor, int, float)) for v in state[p].values()) for p in params
    )


def _names_of(flat: dict[str, Any], optimizer: torch.optim.Optimizer) -> list[str] | None:
    """The name torch's flattened state gave each parameter: its ``param_groups.<name>.<key>`` entries come in the
    parameters' order, one run of the group's keys each. ``None`` if they cannot be matched."""
    entries = iter([k for k in flat if k.startswith("param_groups.")])
    names: list[str] = []
    for group in optimizer.param_groups:
        suffixes = [f".{k}" for k in group if k != "params"]
        if not suffixes:
            return None
        for _ in group["params"]:
            run = [next(entries, "") for _ in suffixes]
            if not run[0].endswith(suffixes[0]):
                return None
            name = run[0][len("param_groups.") : -len(suffixes[0])]
            if run != [f"param_groups.{name}{x}" for x in suffixes]:
                return None
            names.append(name)
    return names if next(entries, None) is None else None


def _flatten(osd: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """``optimizer.state_dict()`` (state keyed by parameter index) flattened under ``names``, as torch does."""
    out: dict[str, Any] = {}
    for index, state in osd["state"].items():
        prefix = f"state.{names[index]}."
        for key, value in state.items():
            out[prefix + str(key)] = value
    for group in osd["param_groups"]:
        values = [(k, v) for k, v in group.items() if k != "params"]
        for index in group["params"]:
            prefix = f"param_groups.{names[index]}."
            for key, value in values:
                out[prefix + key] = value
    return out


def load_optimizer_state(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    tensors: dict[str, Tensor],
    values: dict[str, Any],
    aliases: dict[str, str],
) -> None:
    """Set ``optimizer``'s state and hyper-parameters from flattened entries under stored names (``tensors`` and
    the other ``values``; ``aliases``: a tied parameter's other names -> its stored name).

    Each parameter's entries are found under one of its names and handed to ``optimizer.load_state_dict``: a fresh
    optimizer is not first given a state by a step on zero gradients, as torch's ``set_optimizer_state_dict`` does
    (0.19 s for 192 MiB of Adam state on one core). Where the names do not match (a wrapped module), torch's call.
    """
    entries = _entries_by_parameter(module, optimizer, {**values, **tensors}, aliases)
    if entries is None:
        current = optimizer_state(module, optimizer)
        flat: dict[str, Any] = {
            k: tensors[stored_name(k, aliases)] if isinstance(v, Tensor) else values.get(stored_name(k, aliases), v)
            for k, v in current.items()
        }
        set_optimizer_state_dict(module, optimizer, flat, options=FLAT_OPTIMIZER_STATE)
        return
    state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    taken: set[int] = set()
    index = 0
    for group in optimizer.param_groups:
        first = entries[index] if group["params"] else {"param_groups": {}}
        groups.append({**{k: first["param_groups"].get(k, v) for k, v in group.items()}, "params": []})
        for _ in group["params"]:
            entry = entries[index]
            if entry["state"]:
                copy = id(entry) in taken  # a second copy of a tied weight on this rank: tensors of its own
                state[index] = {
                    k: v.clone() if copy and isinstance(v, Tensor) else v for k, v in entry["state"].items()
                }
                taken.add(id(entry))
            groups[-1]["params"].append(index)
            index += 1
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _entries_by_parameter(
    module: nn.Module, optimizer: torch.optim.Optimizer, flat: dict[str, Any], aliases: dict[str, str]
) -> list[dict[str, dict[str, Any]]] | None:
    """Per parameter of ``optimizer`` (in its order): its ``state`` and ``param_groups`` entries in ``flat``.
    ``None`` if a key is not of torch's flattened form or a parameter has no entries under any of its names."""
    by_name: dict[str, dict[str, dict[str, Any]]] = {}
    for key, value in flat.items():
        kind, _, rest = key.partition(".")
        name, _, field = rest.rpartition(".")
        if kind not in ("state", "param_groups") or not name:
            return None
        by_name.setdefault(name, {"state": {}, "param_groups": {}})[kind][field] = value
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(aliases.get(name, name))
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            found = next((by_name[n] for n in names.get(id(p), []) if n in by_name), None)
            if found is None:
                return None
            out.append(found)
    return out
