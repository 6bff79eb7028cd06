"""What one rank contributes to a checkpoint, and how it goes back into a model, optimizers and RNGs.

    payload = split_checkpoint(lightning_checkpoint, copy=True)   # tensors (for DCP) + JSON parts
    restore_rng(payload.rng)

A Lightning checkpoint dict (``trainer._checkpoint_connector.dump_checkpoint()``) holds the
rank's ``state_dict`` and flattened optimizer states (keyed by parameter name, see
``flat_optimizer.optimizer_state``); tensors go to the shards, everything else (optimizer
hyper-parameters, loops, callbacks, LR schedulers, precision state) to the JSON manifest.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_spot.checkpoint import model_copies
from lightning_spot.checkpoint.jsonstate import decode, encode
from lightning_spot.checkpoint.staging import Staging
from lightning_spot.data.streams.fixed_layout import replica_states

log = logging.getLogger(__name__)

#: Lightning checkpoint keys that are not training state, or live in the shards
_NOT_STATE = {"state_dict", "optimizer_states", "hparams_type"}
#: kept when JSON can hold them (an export to a ``.ckpt`` needs them; resuming does not: user code rebuilds the module)
_BEST_EFFORT = {"hyper_parameters", "hparams_name", "datamodule_hyper_parameters", "datamodule_hparams_name"}


@dataclass
class Payload:
    """One rank's share of a checkpoint: tensors for the shards, JSON-ready values for the manifest."""

    tensors: dict[str, dict[str, Tensor]]
    optimizer_values: list[Any] = field(default_factory=list)
    rng: Any = None
    lightning: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for group in self.tensors.values() for t in group.values())


def _copy(t: Tensor, copy: bool, staging: Staging | None = None, group: str = "", name: str = "") -> Tensor:
    t = t.detach()
    if not copy:
        return t
    if staging is not None:
        return staging.copy(group, name, t)
    return t.to("cpu", copy=True) if t.device.type != "cpu" else t.clone()


def _encode_lightning(checkpoint: dict[str, Any], copies: Iterable[model_copies.Path] = ()) -> dict[str, Any]:
    checkpoint = model_copies.with_marks(checkpoint, copies)
    out: dict[str, Any] = {}
    for key, value in checkpoint.items():
        if key in _NOT_STATE:
            continue
        if key == "callbacks" and isinstance(value, dict):
            callbacks = {}
            for name, state in value.items():
                try:
                    callbacks[name] = encode(state, f"callbacks[{name}]")
                except TypeError as err:
                    log.warning("lightning-spot: not checkpointing the state of callback %s: %s", name, err)
            out[key] = callbacks
            continue
        try:
            out[key] = encode(value, key)
        except TypeError as err:
            (log.debug if key in _BEST_EFFORT else log.warning)("lightning-spot: not checkpointing %r: %s", key, err)
    return out


def split_checkpoint(
    checkpoint: dict[str, Any],
    *,
    copy: bool,
    with_lightning: bool,
    staging: Staging | None = None,
    aliases: dict[str, str] | None = None,
) -> Payload:
    """Split a Lightning checkpoint dict; ``copy`` stages tensors on the CPU (for background writing), into
    ``staging``'s reused buffers when given. Entries that copy the model's state (``checkpoint/model_copies.py``)
    go with the model, under the names checkpoints store (``aliases``: a tied parameter's other names)."""
    aliases = aliases or {}
    model = stored_names(checkpoint["state_dict"], aliases)
    copies = model_copies.find(checkpoint, model, lambda state: stored_names(state, aliases))
    tensors: dict[str, dict[str, Tensor]] = {}
    for group, named in [("model", model), *((model_copies.group_of(k), v) for k, v in copies.items())]:
        tensors[group] = {k: _copy(v, copy, staging, group, k) for k, v in named.items()}
    values = []
    for i, flat in enumerate(checkpoint.get("optimizer_states", [])):
        group = f"optimizer_{i}"
        tensors[group] = {k: _copy(v, copy, staging, group, k) for k, v in flat.items() if isinstance(v, Tensor)}
        values.append(encode({k: v for k, v in flat.items() if not isinstance(v, Tensor)}, f"optimizer_{i}"))
    return Payload(
        tensors=tensors,
        optimizer_values=values,
        rng=capture_rng(),
        lightning=_encode_lightning(checkpoint, copies) if with_lightning else _replica_streams(checkpoint),
    )


def restored_lightning(
    encoded: dict[str, Any], module: nn.Module, aliases: dict[str, str], tensors: dict[str, dict[str, Tensor]]
) -> dict[str, Any]:
    """The Lightning checkpoint dict to hand Lightning after this rank's state was loaded: the manifest's part
    (``encoded``), with the copies of the model's state among ``tensors`` (read under stored names) in place."""
    checkpoint = decode(encoded)
    model_copies.fill(checkpoint, module.state_dict(), tensors, lambda name: stored_name(name, aliases))
    checkpoint.setdefault("state_dict", {})
    checkpoint.setdefault("optimizer_states", [])
    return checkpoint


def _replica_streams(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The one part of the Lightning state that differs between replicas, for a rank that does not send the rest:
    per-replica stream positions (mode "fixed layout"), which the manifest gathers from every replica."""
    states = replica_states(checkpoint)
    if states is None:
        return {}
    return {"loops": {"fit_loop": {"state_dict": {"combined_loader": encode(states, "per-replica stream states")}}}}


def stored_name(key: str, aliases: dict[str, str]) -> str:
    """The name a checkpoint stores ``key`` under: a tied parameter's other names (``aliases``: name -> stored
    name) become its stored name, in model keys and in flattened optimizer keys (``state.<name>.exp_avg``)."""
    if key in aliases:
        return aliases[key]
    for prefix in ("state.", "param_groups."):
        if key.startswith(prefix):
            rest = key[len(prefix) :]
            for alias, name in aliases.items():
                if rest.startswith(alias + "."):
                    return prefix + name + rest[len(alias) :]
    return key


def stored_names(state: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
    """``state`` under the names checkpoints store: each tied parameter once (the first copy met)."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        out.setdefault(stored_name(key, aliases), value)
    return out


def capture_rng() -> Any:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    return encode(state, "rng")


def restore_rng(encoded: Any) -> None:
    state = decode(encoded)
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
