"""Write one checkpoint: every rank's shards, then the manifest that commits it.

    manifest = write_checkpoint(storage, "step-000000200", payload, info=..., group=group)   # collective

The manifest (``manifest.json``, plain JSON) is written last, by rank 0, as a single object: a
checkpoint directory without it does not exist for readers. It records the step, the layout,
the data position, every file's size and CRC32C, the optimizer hyper-parameters, Lightning's
loop / callback / scheduler state and the versions that wrote it. Each rank's RNG state is a small
JSON file of its own (``rng-rankNNNNN.json``), listed and checksummed like the shards.
"""

from __future__ import annotations

import datetime
import logging
import platform
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_spot._version import __version__
from lightning_spot.checkpoint.durable.from_snapshot import KIND, upload_share
from lightning_spot.checkpoint.durable.shards import save_shards
from lightning_spot.checkpoint.durable.storage import MANIFEST, Storage, join, retry
from lightning_spot.checkpoint.memory.snapshot import SnapshotStore
from lightning_spot.checkpoint.payload import Payload
from lightning_spot.data.streams.fixed_layout import merge_replica_states, replica_states
from lightning_spot.utils.distributed import all_gather_object, gather_object_to_first, rank

FORMAT = "lightning-spot-checkpoint/1"
log = logging.getLogger(__name__)


def rng_filename(global_rank: int) -> str:
    """The name of a rank's random-state file in a checkpoint directory."""
    return f"rng-rank{global_rank:05d}.json"


def versions() -> dict[str, str]:
    import lightning

    return {
        "lightning_spot": __version__,
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "python": platform.python_version(),
    }


def write_checkpoint(
    storage: Storage,
    rel: str,
    payload: Payload,
    *,
    info: dict[str, Any],
    group: dist.ProcessGroup | None = None,
    thread_count: int = 2,
    snapshot: tuple[SnapshotStore, int] | None = None,
    discard: bool = False,
    release: Callable[[], None] | None = None,
) -> dict[str, Any] | None:
    """Write shards (all ranks) and commit with the manifest (first rank). Returns the manifest there.

    With ``snapshot`` (a store and step holding this rank's share of the same state), the share's files
    are uploaded as they are (a checkpoint of kind ``"shares"``) instead of DCP shards, when every rank's
    share was written. ``discard``: this rank's copy of the state is not that of one step (it changed while
    being copied): no rank writes anything, and ``None`` is returned everywhere. ``release`` is called once
    ``payload``'s tensors are read no more (its host buffers may take the next copy).
    """
    start = time.monotonic()
    url = storage.url_of(rel)
    if rank(group) == 0 and storage.fs.exists(storage.path_of(rel)):
        storage.delete(rel)  # debris of an interrupted save of this step, or an older copy being replaced
    # one collective: nobody writes before the debris is gone, every rank uses its snapshot's files or none
    # does, and a copy that is not of one step stops them all
    have_share = snapshot is not None and snapshot[0].has_share(snapshot[1], rank())
    agreed = all_gather_object((have_share, discard), group)
    if any(d for _, d in agreed):
        if rank(group) == 0:
            log.warning(
                "lightning-spot: the checkpoint of step %s is not written (its state changed while copied)",
                info.get("step"),
            )
        return None
    if not all(h for h, _ in agreed):
        snapshot = None
    share = None
    if snapshot is not None:
        if release is not None:
            release()  # the snapshot's files are uploaded, not the payload's tensors
        store, step = snapshot
        digests = retry(lambda: upload_share(storage, rel, store, step, rank()), f"uploading a share to {url}")
        share = (rank(), store.read_meta(step, rank()))
    else:
        # a failure on any rank is raised on all of them (DCP gathers the results), so all retry together
        digests = retry(
            lambda: save_shards(url, payload.tensors, storage.options, process_group=group, thread_count=thread_count),
            f"writing the shards of {url}",
        )
        if release is not None:
            release()
        rng_name = rng_filename(rank())
        digests[rng_name] = storage.write_json(join(rel, rng_name), payload.rng)
    first = rank(group) == 0
    parts = gather_object_to_first(
        (
            digests,
            payload.optimizer_values,
            payload.lightning if first else None,
            share,
            replica_states(payload.lightning),
        ),
        group,
    )
    if parts is None:
        return None
    files: dict[str, Any] = {}
    optimizer_values: list[dict[str, Any]] = []
    shares = {}
    merge_replica_states(parts[0][2], [p[4] for p in parts])  # per-replica streams: every replica's position
    for rank_digests, values, _, rank_share, _ in parts:
        files.update(rank_digests)
        if rank_share is not None:
            shares[str(rank_share[0])] = {k: rank_share[1][k] for k in ("names", "pp_rank")}
        for i, v in enumerate(values):
            if len(optimizer_values) <= i:
                optimizer_values.append({})
            optimizer_values[i].update(v)
    manifest = {
        "format": FORMAT,
        **({"kind": KIND, "shares": shares} if shares else {}),
        **{k: v for k, v in info.items() if k not in ("timings",)},
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "files": files,
        "bytes": sum(f["size"] for f in files.values()),
        "optimizer_values": optimizer_values,
        "lightning": parts[0][2],
        "timings": {**info.get("timings", {}), "write_seconds": round(time.monotonic() - start, 4)},
        "versions": versions(),
    }
    storage.write_json(join(rel, MANIFEST), manifest)
    return manifest
