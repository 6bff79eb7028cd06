"""Find, verify and load the latest good checkpoint onto the current layout.

    checkpoint, manifest = load_checkpoint("s3://bucket/run", opts, module, optimizers)  # collective

``url`` is a run directory (the latest committed ``step-*`` checkpoint is used) or one checkpoint
directory. Every file listed in the manifest is checked for presence and size (one listing) and
for its CRC32 as it is read; a damaged checkpoint is skipped with a warning that says what was
wrong, and the previous committed one is tried.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from lightning_spot.checkpoint.jsonstate import decode
from lightning_spot.checkpoint.shards import ChecksumError, load_shards
from lightning_spot.checkpoint.storage import MANIFEST, Storage
from lightning_spot.checkpoint.payload import FLAT_OPTIMIZER_STATE, optimizer_state, restore_rng
from lightning_spot.checkpoint.write import FORMAT

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """No usable checkpoint could be loaded; the message lists what was wrong with each candidate."""


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _broadcast(obj: Any, group: dist.ProcessGroup | None) -> Any:
    if not _initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def _all_gather(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    if not _initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def candidates(storage: Storage) -> list[str]:
    """Checkpoint directories to try, newest first ("" when ``storage`` is itself one checkpoint)."""
    if storage.fs.exists(storage.path_of(MANIFEST)):
        return [""]
    return list(reversed(storage.committed()))


def read_manifest(storage: Storage, rel: str) -> tuple[dict[str, Any] | None, str | None]:
    try:
        manifest = storage.read_json(f"{rel}/{MANIFEST}" if rel else MANIFEST)
    except FileNotFoundError:
        return None, "the manifest is missing"
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        return None, f"the manifest is not valid JSON ({err})"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return None, f"the manifest is not a {FORMAT} manifest"
    return manifest, None


def check_files(storage: Storage, rel: str, manifest: dict[str, Any], group: dist.ProcessGroup | None) -> list[str]:
    """Missing or wrongly sized files of one checkpoint (one listing; the same list on every rank).

    Checksums are verified while the files are read for loading (see ``shards.SafeReader``).
    """
    problems: list[str] = []
    if not _initialized() or dist.get_rank(group) == 0:
        present = storage.sizes(rel)
        for name, meta in sorted(manifest["files"].items()):
            if name not in present:
                problems.append(f"{name} is missing")
            elif present[name] != meta["size"]:
                problems.append(f"{name} has {present[name]} bytes, expected {meta['size']} (truncated?)")
    return _broadcast(problems, group)


def describe_failure(err: BaseException) -> str:
    """A one-line reason from a load failure (DCP wraps per-rank errors in CheckpointException)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        err = first[0] if isinstance(first, tuple) else first
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def restore_training_state(
    storage: Storage,
    rel: str,
    manifest: dict[str, Any],
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    *,
    group: dist.ProcessGroup | None,
    same_layout: bool,
) -> None:
    """Load model and optimizer state for this rank's stages (resharded by name), and RNGs if the layout is unchanged."""
    saved_values = [decode(v) for v in manifest.get("optimizer_values", [])]
    if len(saved_values) != len(optimizers):
        raise CheckpointError(
            f"the checkpoint has {len(saved_values)} optimizer(s) but configure_optimizers returned {len(optimizers)}"
        )
    target: dict[str, Any] = {"model": get_model_state_dict(module)}
    flats = [optimizer_state(module, opt) for opt in optimizers]
    for i, flat in enumerate(flats):
        target[f"optimizer_{i}"] = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    url = storage.url_of(rel) if rel else storage.url
    load_shards(url, target, storage.options, process_group=group, expected=manifest["files"])
    set_model_state_dict(module, target["model"])
    for i, (opt, flat) in enumerate(zip(optimizers, flats)):
        values = {k: saved_values[i].get(k, v) for k, v in flat.items() if not isinstance(v, torch.Tensor)}
        set_optimizer_state_dict(module, opt, {**target[f"optimizer_{i}"], **values}, options=FLAT_OPTIMIZER_STATE)
    rank = dist.get_rank() if _initialized() else 0
    rng_name = f"rng-rank{rank:05d}.json"
    if same_layout and rng_name in manifest["files"]:
        try:
            restore_rng(storage.read_json(f"{rel}/{rng_name}" if rel else rng_name, expected=manifest["files"][rng_name]))
        except ChecksumError as err:
            log.warning("lightning-spot: not restoring this rank's random state: %s", err)


def load_checkpoint(
    url: str,
    storage_options: dict[str, Any] | None,
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    *,
    layout: dict[str, Any] | None = None,
    group: dist.ProcessGroup | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load the newest intact checkpoint under ``url``; returns (Lightning checkpoint dict, manifest)."""
    storage = Storage(url, storage_options)
    names = _broadcast(candidates(storage) if (not _initialized() or dist.get_rank(group) == 0) else None, group)
    if not names:
        raise CheckpointError(
            f"No committed checkpoint under {url!r} (a checkpoint exists once its {MANIFEST} is written)."
        )
    rejected = []
    for rel in names:
        manifest, problem = read_manifest(storage, rel) if (not _initialized() or dist.get_rank(group) == 0) else (None, None)
        manifest, problem = _broadcast((manifest, problem), group)
        problems = [problem] if problem else check_files(storage, rel, manifest, group)
        where = storage.url_of(rel) if rel else storage.url
        if not problems:
            same = layout is not None and manifest.get("layout") == layout
            try:
                restore_training_state(storage, rel, manifest, module, optimizers, group=group, same_layout=same)
            except (CheckpointException, ChecksumError) as err:  # raised on every rank alike
                problems = [describe_failure(err)]
        if problems:
            rejected.append(f"{where}: {'; '.join(problems[:5])}")
            log.warning("lightning-spot: checkpoint %s is damaged (%s); trying an earlier one", where, "; ".join(problems[:5]))
            continue
        checkpoint = decode(manifest.get("lightning", {}))
        checkpoint.setdefault("state_dict", {})
        checkpoint.setdefault("optimizer_states", [])
        return checkpoint, manifest
    raise CheckpointError("No usable checkpoint under " + repr(url) + ":\n  " + "\n  ".join(rejected))
