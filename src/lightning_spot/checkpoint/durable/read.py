"""Find, verify and load the latest good checkpoint onto the current layout.

    checkpoint, manifest = load_checkpoint("s3://bucket/run", opts, module, optimizers)  # collective

``url`` is a run directory (the latest committed ``step-*`` checkpoint is used) or one checkpoint
directory. Every file listed in the manifest is checked for presence and size (one listing) and
for its CRC32C as it is read; a damaged checkpoint is skipped with a warning that says what was
wrong, and the previous committed one is tried.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    set_model_state_dict,
)

from lightning_spot.checkpoint import model_copies
from lightning_spot.checkpoint.checksum import ChecksumError
from lightning_spot.checkpoint.durable import from_snapshot
from lightning_spot.checkpoint.durable.shards import load_shards
from lightning_spot.checkpoint.durable.storage import MANIFEST, Storage, join
from lightning_spot.checkpoint.durable.write import FORMAT, rng_filename
from lightning_spot.checkpoint.flat_optimizer import load_optimizer_state, optimizer_state
from lightning_spot.checkpoint.jsonstate import decode
from lightning_spot.checkpoint.memory.recall import Recall
from lightning_spot.checkpoint.payload import (
    restore_rng,
    restored_lightning,
    stored_name,
    stored_names,
)
from lightning_spot.layout import LayoutError, PipelineLayout
from lightning_spot.utils.distributed import broadcast_object, rank

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """No usable checkpoint could be loaded; the message lists what was wrong with each candidate."""


T = TypeVar("T")
#: errors that mean "this checkpoint's files are damaged" (raised on every rank alike)
LOAD_FAILURES = (CheckpointException, ChecksumError)


def candidates(storage: Storage) -> list[str]:
    """Checkpoint directories to try, newest first ("" when ``storage`` is itself one checkpoint)."""
    if storage.fs.exists(storage.path_of(MANIFEST)):
        return [""]
    return list(reversed(storage.committed()))


def read_manifest(storage: Storage, rel: str) -> tuple[dict[str, Any] | None, str | None]:
    try:
        manifest = storage.read_json(join(rel, MANIFEST))
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
    if rank(group) == 0:
        present = storage.sizes(rel)
        for name, meta in sorted(manifest["files"].items()):
            if name not in present:
                problems.append(f"{name} is missing")
            elif present[name] != meta["size"]:
                problems.append(f"{name} has {present[name]} bytes, expected {meta['size']} (truncated?)")
    return broadcast_object(problems, group)


def newest_intact(
    storage: Storage, use: Callable[[str, dict[str, Any]], T], *, group: dist.ProcessGroup | None = None
) -> T:
    """``use(rel, manifest)`` for the newest committed checkpoint whose files are all there and intact.

    Walks the run's checkpoints newest first. One whose manifest is unreadable, whose files are
    missing or have the wrong size, or for which ``use`` raises a load failure (a checksum mismatch,
    say) is skipped with a warning that says what was wrong. A collective call when a process group
    exists (the first rank of ``group`` reads the listings and manifests). Raises
    :class:`CheckpointError` listing every rejected checkpoint when none is usable.
    """
    names = broadcast_object(candidates(storage) if rank(group) == 0 else None, group)
    if not names:
        raise CheckpointError(
            f"No committed checkpoint under {storage.url!r} (a checkpoint exists once its {MANIFEST} is written)."
        )
    rejected = []
    for rel in names:
        manifest, problem = read_manifest(storage, rel) if rank(group) == 0 else (None, None)
        manifest, problem = broadcast_object((manifest, problem), group)
        problems = [problem] if problem else check_files(storage, rel, manifest, group)
        where = storage.url_of(rel)
        if not problems:
            try:
                return use(rel, manifest)
            except LOAD_FAILURES as err:
                problems = [describe_failure(err)]
        rejected.append(f"{where}: {'; '.join(problems[:5])}")
        log.warning(
            "lightning-spot: checkpoint %s is damaged (%s); trying an earlier one", where, "; ".join(problems[:5])
        )
    raise CheckpointError("No usable checkpoint under " + repr(storage.url) + ":\n  " + "\n  ".join(rejected))


def describe_failure(err: BaseException) -> str:
    """A one-line reason from a load failure (DCP wraps per-rank errors in CheckpointException)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        err = first[0] if isinstance(first, tuple) else first
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def _stored_target(
    module: nn.Module, optimizers: list[torch.optim.Optimizer], aliases: dict[str, str]
) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's model and optimizer tensors under the names checkpoints store (to be filled in place)."""
    target: dict[str, dict[str, torch.Tensor]] = {"model": stored_names(get_model_state_dict(module), aliases)}
    for i, opt in enumerate(optimizers):
        tensors = {k: v for k, v in optimizer_state(module, opt).items() if isinstance(v, torch.Tensor)}
        target[f"optimizer_{i}"] = stored_names(tensors, aliases)
    return target


def apply_training_state(
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    tensors: dict[str, dict[str, torch.Tensor]],
    optimizer_values: list[dict[str, Any]],
    aliases: dict[str, str],
) -> None:
    """Set this rank's parameters and optimizer state from tensors (and optimizer values) under stored names."""
    local_model = get_model_state_dict(module)
    set_model_state_dict(module, {k: tensors["model"][stored_name(k, aliases)] for k in local_model})
    for i, opt in enumerate(optimizers):
        load_optimizer_state(module, opt, tensors[f"optimizer_{i}"], optimizer_values[i], aliases)


def restore_training_state(
    storage: Storage,
    rel: str,
    manifest: dict[str, Any],
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    *,
    group: dist.ProcessGroup | None,
    same_layout: bool,
    aliases: dict[str, str] | None = None,
) -> dict[str, dict[str, torch.Tensor]]:
    """Load model and optimizer state for this rank's stages (resharded by name), and RNGs if the layout is unchanged;
    return the copies of the model's state the checkpoint holds (``model_copies``: by group, under stored names).

    ``aliases`` (other name -> stored name) maps this rank's copies of tied parameters to the one stored copy.
    """
    aliases = aliases or {}
    saved_values = [decode(v) for v in manifest.get("optimizer_values", [])]
    if len(saved_values) != len(optimizers):
        raise CheckpointError(
            f"the checkpoint has {len(saved_values)} optimizer(s) but configure_optimizers returned {len(optimizers)}"
        )
    target = _stored_target(module, optimizers, aliases)
    target |= model_copies.targets(target["model"], model_copies.marked(decode(manifest.get("lightning", {}))))
    if manifest.get("kind") == from_snapshot.KIND:  # each rank's snapshot files: read those holding our names
        needs = {group_name: set(named) for group_name, named in target.items()}
        target = from_snapshot.read_shares(storage, rel, manifest, needs, prefer=rank() if same_layout else None)
        apply_training_state(module, optimizers, target, saved_values, aliases)
        state = from_snapshot.read_share_state(storage, rel, manifest, rank()) if same_layout else None
        if state is not None:
            restore_rng(state["rng"])
        return model_copies.groups_in(target)
    load_shards(storage.url_of(rel), target, storage.options, process_group=group, expected=manifest["files"])
    apply_training_state(module, optimizers, target, saved_values, aliases)
    rng_name = rng_filename(rank())
    if same_layout and rng_name in manifest["files"]:
        try:
            restore_rng(storage.read_json(join(rel, rng_name), expected=manifest["files"][rng_name]))
        except ChecksumError as err:
            log.warning("lightning-spot: not restoring this rank's random state: %s", err)
    return model_copies.groups_in(target)


def load_checkpoint(
    url: str,
    storage_options: dict[str, Any] | None,
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    *,
    layout: PipelineLayout | None = None,
    group: dist.ProcessGroup | None = None,
    aliases: dict[str, str] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load the newest intact checkpoint under ``url`` (collective); returns (Lightning checkpoint dict, manifest).

    Random states are restored only when the checkpoint was written on ``layout``.
    """
    storage = Storage(url, storage_options)

    def restore(rel: str, manifest: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        same = layout is not None and written_on(manifest) == layout
        copies = restore_training_state(
            storage, rel, manifest, module, optimizers, group=group, same_layout=same, aliases=aliases
        )
        return restored_lightning(manifest.get("lightning", {}), module, aliases or {}, copies), manifest

    return newest_intact(storage, restore, group=group)


def written_on(manifest: dict[str, Any]) -> PipelineLayout | None:
    """The layout a checkpoint was written on (``None`` if its manifest does not record a readable one)."""
    try:
        return PipelineLayout.from_dict(manifest.get("layout") or {})
    except LayoutError:
        return None


def snapshot_needs(
    module: nn.Module, optimizers: list[torch.optim.Optimizer], aliases: dict[str, str]
) -> dict[str, list[str]]:
    """The stored names of this rank's model and optimizer tensors (what a recall from memory must provide).

    Naming the optimizer's state makes torch initialise it (a step with zero gradients): a fresh optimizer
    is given its empty state back, so that a run that does not resume starts as it would have.
    """
    fresh = [opt for opt in optimizers if not opt.state]
    needs = {group: sorted(named) for group, named in _stored_target(module, optimizers, aliases).items()}
    for opt in fresh:
        opt.state.clear()
    return needs


def load_snapshot(
    recall: Recall,
    step: int,
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    *,
    layout: PipelineLayout,
    aliases: dict[str, str] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Collective: restore this rank's state of ``step`` from the surviving in-memory snapshots, onto any
    layout; returns (Lightning checkpoint dict, the snapshot's info)."""
    got = recall.fetch(step)
    values = [decode(v) for v in got.optimizer_values]
    if len(values) != len(optimizers):
        raise CheckpointError(
            f"the snapshot has {len(values)} optimizer(s) but configure_optimizers returned {len(optimizers)}"
        )
    apply_training_state(module, optimizers, got.tensors, values, aliases or {})
    if got.rng is not None and written_on({"layout": got.layout}) == layout:
        restore_rng(got.rng)
    return restored_lightning(got.lightning, module, aliases or {}, got.tensors), got.info
