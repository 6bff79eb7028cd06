"""The two tiers a run checkpoints to, opened at setup with every rank agreeing: host memory and storage.

    snapshots = open_snapshots(url, snapshot_dir, explicit=False)   # None: no usable tmpfs (a warning)
    check_storage(storage, snapshots is not None)                   # unreachable: an error, or a warning
                                                                    # when memory can still resume the run

Both are collective (every rank's problem is gathered), so that every rank goes on alike.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch.distributed as dist

from lightning_spot.checkpoint.durable.storage import Storage, StorageError
from lightning_spot.checkpoint.memory.snapshot import SnapshotError, SnapshotStore
from lightning_spot.utils.distributed import all_gather_object, is_initialized

log = logging.getLogger(__name__)


def open_snapshots(
    url: str, snapshot_dir: Optional[str], explicit: bool, part: Optional[str] = None
) -> Optional[SnapshotStore]:
    """The node's snapshot store (``part``: this process group's among several that train the run); a missing or
    read-only tmpfs fails here, before training, when snapshots were asked for by an interval (``explicit``), and
    turns them off (every rank alike) when they are on by default."""
    store = SnapshotStore.for_run(url, snapshot_dir, part)
    problem = None
    try:
        store.check()
    except SnapshotError as err:
        if explicit:
            raise
        problem = str(err)
    first = next((p for p in all_gather_object(problem) if p), None)
    if first is not None:
        log.warning("lightning-spot: running without snapshots in host memory: %s", first)
        return None
    if is_initialized() and store.group is None:
        store.group = dist.new_group(backend="gloo")  # snapshot traffic, off the training group
    return store


def check_storage(storage: Storage, snapshots: bool) -> None:
    """Fail (every rank) when a rank cannot write the run directory, unless memory can resume the run then."""
    problem = None
    try:
        storage.check_access()
    except StorageError as err:
        problem = str(err)
    first = next((p for p in all_gather_object(problem) if p), None)
    if first and not snapshots:
        raise StorageError(first)
    if first:  # a restart during a storage outage can still resume from host memory
        log.warning("lightning-spot: %s; continuing with in-memory snapshots, durable saves may fail", first)
