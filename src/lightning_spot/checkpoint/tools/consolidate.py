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

from lightning_spot.checkpoint.durable import from_snapshot
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
        weights: dict[str, torch.Tensor] = {}
        for _, names in model_groups(storage, rel, manifest):
            weights.update(read_model(storage, rel, manifest, names))
        for alias, name in manifest.get("tied", {}).items():  # a tied parameter is stored once
            if name in weights:
                weights[alias] = weights[name]
        return weights

    return newest_intact(storage, read)


def model_groups(storage: Storage, rel: str, manifest: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """The model tensors of checkpoint ``rel`` (each stored name once), grouped by the file that holds them:
    (file, names) in file order. Reading one group at a time holds one file's model tensors."""
    groups: dict[str, list[str]] = {}
    if manifest.get("kind") == from_snapshot.KIND:  # snapshot shares: one per rank; replicas hold the same names
        seen: set[str] = set()
        for r in sorted(manifest["shares"], key=int):
            names = [n for n in manifest["shares"][r]["names"].get("model", ()) if n not in seen]
            seen.update(names)
            if names:
                groups[from_snapshot.share_name(int(r), from_snapshot.TENSORS)] = names
        return list(groups.items())
    metadata = SafeReader(storage.url_of(rel), storage.options).read_metadata()
    for index, info in metadata.storage_data.items():
        if index.fqn.startswith("model."):
            names = groups.setdefault(info.relative_path, [])
            if index.fqn[len("model.") :] not in names:
                names.append(index.fqn[len("model.") :])
    return sorted(groups.items())


def read_model(storage: Storage, rel: str, manifest: dict[str, Any], names: list[str]) -> dict[str, torch.Tensor]:
    """The model tensors ``names`` of checkpoint ``rel``, read into fresh CPU memory and checked."""
    if manifest.get("kind") == from_snapshot.KIND:
        return from_snapshot.read_shares(storage, rel, manifest, {"model": set(names)})["model"]
    reader = SafeReader(storage.url_of(rel), storage.options, manifest["files"])
    metadata = reader.read_metadata()
    wanted = set(names)
    state: dict[str, Any] = {"model": {}}
    for key, meta in metadata.state_dict_metadata.items():
        name = key[len("model.") :]
        if key.startswith("model.") and name in wanted and isinstance(meta, TensorStorageMetadata):
            state["model"][name] = torch.empty(meta.size, dtype=meta.properties.dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state["model"]
