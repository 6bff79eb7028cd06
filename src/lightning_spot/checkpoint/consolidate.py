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
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_spot.checkpoint.read import CheckpointError, candidates, check_files, describe_failure, read_manifest
from lightning_spot.checkpoint.shards import ChecksumError, SafeReader
from lightning_spot.checkpoint.storage import Storage

log = logging.getLogger(__name__)


def _committed(storage: Storage) -> list[tuple[str, dict[str, Any] | None, list[str]]]:
    """Candidates newest first, with their manifest and the problems found without reading shards."""
    out = []
    for rel in candidates(storage):
        manifest, problem = read_manifest(storage, rel)
        problems = [problem] if problem else check_files(storage, rel, manifest, None)
        out.append((rel, manifest, problems))
    return out


def latest_intact(storage: Storage) -> tuple[str, dict[str, Any]]:
    """The newest committed checkpoint whose files are all present with the right sizes (name, manifest)."""
    rejected = []
    for rel, manifest, problems in _committed(storage):
        if not problems:
            assert manifest is not None
            return rel, manifest
        rejected.append(f"{storage.url_of(rel) if rel else storage.url}: {'; '.join(problems[:5])}")
    detail = ("\n  " + "\n  ".join(rejected)) if rejected else " (none committed)"
    raise CheckpointError(f"No usable checkpoint under {storage.url!r}:{detail}")


def load_full_state_dict(url: str, storage_options: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Consolidated model weights (parameter name -> tensor, on CPU) of a run's latest intact checkpoint,
    or of the checkpoint ``url`` names. Every file is checked against its CRC32 as it is read; nothing
    is unpickled but DCP's metadata (allow-listed)."""
    storage = Storage(url, storage_options)
    rejected = []
    for rel, manifest, problems in _committed(storage):
        where = storage.url_of(rel) if rel else storage.url
        if not problems:
            assert manifest is not None
            try:
                return _read_model(where, storage.options, manifest["files"])
            except (CheckpointException, ChecksumError) as err:
                problems = [describe_failure(err)]
        rejected.append(f"{where}: {'; '.join(problems[:5])}")
        log.warning("lightning-spot: checkpoint %s is damaged (%s); trying an earlier one", where, "; ".join(problems[:5]))
    detail = ("\n  " + "\n  ".join(rejected)) if rejected else " (none committed)"
    raise CheckpointError(f"No usable checkpoint under {storage.url!r}:{detail}")


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
