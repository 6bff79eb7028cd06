"""Read a checkpoint outside of training: the consolidated model weights, in one process.

    weights = load_full_state_dict("s3://bucket/runs/gpt")            # latest intact checkpoint of a run
    weights = load_full_state_dict("s3://bucket/runs/gpt/step-000000200", storage_options={...})
    model.load_state_dict(weights)                                     # an ordinary, unsplit model
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_spot.checkpoint.read import CheckpointError, candidates, read_manifest, verify
from lightning_spot.checkpoint.shards import SafeReader
from lightning_spot.checkpoint.storage import Storage

log = logging.getLogger(__name__)


def latest_intact(storage: Storage, *, check: bool = True) -> tuple[str, dict[str, Any]]:
    """The newest committed checkpoint of ``storage`` whose files are intact (name, manifest)."""
    rejected = []
    for rel in candidates(storage):
        manifest, problem = read_manifest(storage, rel)
        problems = [problem] if problem else (verify(storage, rel, manifest, None) if check else [])
        if not problems:
            assert manifest is not None
            return rel, manifest
        where = storage.url_of(rel) if rel else storage.url
        rejected.append(f"{where}: {'; '.join(problems[:5])}")
        log.warning("lightning-spot: checkpoint %s is damaged (%s); trying an earlier one", where, "; ".join(problems[:5]))
    detail = ("\n  " + "\n  ".join(rejected)) if rejected else " (none committed)"
    raise CheckpointError(f"No usable checkpoint under {storage.url!r}:{detail}")


def load_full_state_dict(
    url: str, storage_options: dict[str, Any] | None = None, *, check: bool = True
) -> dict[str, torch.Tensor]:
    """Consolidated model weights (parameter name -> tensor, on CPU) of a run's latest intact checkpoint,
    or of the checkpoint ``url`` names. Nothing is unpickled but DCP's metadata (allow-listed)."""
    storage = Storage(url, storage_options)
    rel, _ = latest_intact(storage, check=check)
    ckpt_url = storage.url_of(rel) if rel else storage.url
    reader = SafeReader(ckpt_url, storage.options)
    metadata = reader.read_metadata()
    state: dict[str, Any] = {"model": {}}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
            state["model"][key[len("model.") :]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=SafeReader(ckpt_url, storage.options), no_dist=True)
    return state["model"]
