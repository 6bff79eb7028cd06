"""Read a checkpoint outside of training: the consolidated model weights, in one process.

weights = load_full_state_dict("s3://bucket/runs/gpt")            # latest intact checkpoint of a run
weights = load_full_state_dict("s3://bucket/runs/gpt/step-000000200", storage_options={...})
model.load_state_dict(weights)                                     # an ordinary, unsplit model
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_spot.checkpoint.durable import shares
from lightning_spot.checkpoint.durable.read import newest_intact
from lightning_spot.checkpoint.durable.shards import SafeReader
from lightning_spot.checkpoint.durable.storage import Storage


def latest_intact(storage: Storage) -> tuple[str, dict[str, Any]]:
    """The newest committed checkpoint whose files are all present with the right sizes (name, manifest)."""
    return newest_intact(storage, lambda rel, manifest: (rel, manifest))


def load_full_state_dict(url: str, storage_options: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Consolidated model weights (parameter name -> tensor, on CPU) of a run's latest intact checkpoint,
    or of the checkpoint ``url`` names. Every file is checked against its CRC32C as it is read; nothing
    is unpickled but DCP's metadata (allow-listed). A tied parameter appears under each of its names, as
    the original model's ``state_dict()`` lists it."""
    storage = Storage(url, storage_options)

    def read(rel: str, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
        if manifest.get("kind") == shares.KIND:  # snapshot shares: every stage's model tensors, once
            names = {n for share in manifest["shares"].values() for n in share["names"].get("model", ())}
            weights = shares.read_shares(storage, rel, manifest, {"model": names})["model"]
        else:
            weights = _read_model(storage.url_of(rel), storage.options, manifest["files"])
        for alias, name in manifest.get("tied", {}).items():  # a tied parameter is stored once
            if name in weights:
                weights[alias] = weights[name]
        return weights

    return newest_intact(storage, read)


def _read_model(url: str, options: dict[str, Any], expected: dict[str, Any]) -> dict[str, torch.Tensor]:
    reader = SafeReader(url, options, expected)
    metadata = reader.read_metadata()
    state: dict[str, Any] = {"model": {}}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
            state["model"][key[len("model.") :]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state["model"]
