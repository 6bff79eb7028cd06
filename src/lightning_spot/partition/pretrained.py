"""Fill this rank's stages from pretrained weights on disk, reading only the tensors it holds.

    weights = SafetensorsWeights("checkpoints/llama-1b")      # a save_pretrained directory (sharded or not)
    loaded = load_stage_weights(module, weights, aliases={...})  # after placement: this rank's names only
    weights.read_names                                         # what was read (nothing else is)

The directory holds ``model.safetensors`` or ``model.safetensors.index.json`` with its shards, as
``transformers``' ``save_pretrained`` writes them. Each tensor is read on its own (safetensors reads
by offset), so a rank reads its stages' tensors and no others. The names in the file are the Hugging
Face model's own (``model.layers.0.mlp.up_proj.weight``); the LightningModule's names carry the
attribute that holds the model (``model.``), found by matching suffixes. A tied parameter stored
under one name (``lm_head.weight`` saved as ``model.embed_tokens.weight``) is read under that name.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from lightning_spot.partition.discovery import ModelContractError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class SafetensorsWeights:
    """The tensors of a ``save_pretrained`` directory, read one at a time on request."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        if (self.path / INDEX).is_file():
            index = json.loads((self.path / INDEX).read_text())
            self.files = {name: self.path / file for name, file in index["weight_map"].items()}
        elif (self.path / SINGLE).is_file():
            from safetensors import safe_open

            with safe_open(str(self.path / SINGLE), framework="pt") as f:
                self.files = dict.fromkeys(f.keys(), self.path / SINGLE)
        else:
            raise ModelContractError(
                f"No pretrained weights in {self.path}: expected {SINGLE} or {INDEX} (what transformers' "
                f"save_pretrained writes)."
            )
        self.read_names: list[str] = []
        self.read_bytes = 0

    @property
    def names(self) -> set[str]:
        return set(self.files)

    def read(self, name: str, device: torch.device) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt", device="cpu") as f:
            tensor = f.get_tensor(name)
        self.read_names.append(name)
        self.read_bytes += tensor.numel() * tensor.element_size()
        return tensor.to(device)


def _file_prefix(local: list[str], names: set[str]) -> str:
    """The part of the LightningModule's names in front of the file's names (``"model."``)."""
    for key in local:
        parts = key.split(".")
        for i in range(len(parts)):
            if ".".join(parts[i:]) in names:
                return ".".join(parts[:i]) + ("." if i else "")
    raise ModelContractError(
        f"None of this rank's parameter names ({', '.join(local[:3])}, ...) ends in a name of the pretrained "
        f"weights ({', '.join(sorted(names)[:3])}, ...): do they belong to this model?"
    )


@torch.no_grad()
def load_stage_weights(module: nn.Module, weights: SafetensorsWeights, aliases: dict[str, str]) -> int:
    """Copy the pretrained value of every parameter and persistent buffer this rank holds; returns how many.

    ``aliases`` (other name -> stored name) says under which name a tied parameter was saved.
    """
    state = module.state_dict(keep_vars=True)
    prefix = _file_prefix(list(state), weights.names)
    done: dict[int, str] = {}
    for key, tensor in state.items():
        if id(tensor) in done:  # one tensor under two names (a tie on this rank): read once
            continue
        candidates = [key, aliases.get(key, key)]
        stored = next((c[len(prefix) :] for c in candidates if c[len(prefix) :] in weights.names), None)
        if stored is None:
            raise ModelContractError(
                f"The pretrained weights in {weights.path} have no tensor for `{key}` (looked for "
                f"`{candidates[0][len(prefix) :]}`). Use the checkpoint of this model's architecture and size."
            )
        value = weights.read(stored, tensor.device)
        if value.shape != tensor.shape:
            raise ModelContractError(
                f"`{stored}` in {weights.path} has shape {tuple(value.shape)}, but this model's `{key}` has "
                f"{tuple(tensor.shape)}: the checkpoint is of another configuration."
            )
        tensor.copy_(value)
        done[id(tensor)] = key
    return len(done)
