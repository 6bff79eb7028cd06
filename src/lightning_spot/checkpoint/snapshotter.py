"""Take in-memory snapshots: copy on the training thread, write and copy to a peer node in the background.

    snapshotter = Snapshotter(store, group, rank=r, world=w, local_world=lw, pp_rank=p, stage_of=layout.grid.same_state_key)
    snapshotter.take(checkpoint, info)       # a Lightning checkpoint dict of this step; returns the stall
    snapshotter.wait(); snapshotter.close()

Redundancy across nodes: when some pipeline stage lives on one node only (the usual placement keeps a
stage's data-parallel replicas together), every rank also sends its share to the rank with the same
local rank on the next node, which keeps it beside its own. Losing one node then loses no stage's
state. When every stage already has replicas on two nodes, no copy is made.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from lightning_spot._dist import all_gather_object, exchange_bytes
from lightning_spot.checkpoint import tensorfile
from lightning_spot.checkpoint.background import start_background
from lightning_spot.checkpoint.payload import Payload, Staging, split_checkpoint
from lightning_spot.checkpoint.snapshot import SnapshotStore

log = logging.getLogger(__name__)

KEEP = 2  # snapshots kept per rank: the newest may be half-written when a node dies


def needs_peer_copy(world: int, local_world: int, stage_of: Callable[[int], int]) -> bool:
    """Whether losing one node would lose some stage's state (its ranks all on that node)."""
    if world <= local_world:
        return False  # one node: nothing to copy to (and a lost node is a lost job's memory anyway)
    nodes_of: dict[int, set[int]] = {}
    for r in range(world):
        nodes_of.setdefault(stage_of(r), set()).add(r // local_world)
    return any(len(nodes) < 2 for nodes in nodes_of.values())


class Snapshotter:
    """Writes this rank's snapshots (one at a time, in a background thread) and, when needed, a peer's."""

    def __init__(
        self,
        store: SnapshotStore,
        group: dist.ProcessGroup | None,
        *,
        rank: int,
        world: int,
        local_world: int,
        stage_of: Callable[[int], int],
    ) -> None:
        self.store = store
        self.group = group
        self.rank = rank
        self.local_world = local_world
        self.stage_of = stage_of
        self.peer_copy = needs_peer_copy(world, local_world, stage_of)
        self.next_peer = (rank + local_world) % world
        self.prev_peer = (rank - local_world) % world
        self.enabled = True
        self.staging = Staging()  # reused once the previous snapshot's thread is done with it
        self.taken: list[dict[str, Any]] = []  # step, stall_seconds, write_seconds, bytes
        self.thread: threading.Thread | None = None  # the newest snapshot's writer
        self._warned = False

    def take(self, checkpoint: dict[str, Any] | Payload, info: dict[str, Any]) -> float:
        """Copy this rank's state of the step (unless given a copied ``Payload``, which a durable checkpoint of
        the same step shares); write it (and the peer copy) in the background. Returns the stall."""
        if not self.enabled:
            return 0.0
        start = time.monotonic()
        self.wait()
        if isinstance(checkpoint, Payload):
            share = checkpoint
        else:
            share = split_checkpoint(checkpoint, copy=True, with_lightning=True, staging=self.staging)
        if not self.taken:
            self._check_room(share.nbytes)
        if not self.enabled:
            return 0.0
        meta = {
            "names": {g: sorted(t) for g, t in share.tensors.items()},
            "layout": info["layout"],
            "pp_rank": self.stage_of(self.rank),
        }
        state = {"rng": share.rng, "optimizer_values": share.optimizer_values, "lightning": share.lightning}
        state["info"] = info
        record: dict[str, Any] = {"step": info["step"], "bytes": share.nbytes}
        self.taken.append(record)
        self.thread = start_background(self._write, info["step"], share.tensors, meta, state, record)
        record["stall_seconds"] = time.monotonic() - start
        return record["stall_seconds"]

    def _check_room(self, nbytes: int) -> None:
        """Before the first snapshot: does every node's memory hold its snapshots? If not, all ranks stop."""
        per_node = nbytes * self.local_world * (KEEP + 1) * (2 if self.peer_copy else 1)  # + the one being written
        free = shutil.disk_usage(self.store.path).free
        short = all_gather_object((per_node, free, self.store.node_key) if free < 1.1 * per_node else None)
        problem = next((s for s in short if s is not None), None)
        if problem is not None:
            need, have, where = problem
            log.warning(
                "lightning-spot: snapshots off: %s has %.0f MiB free, but the snapshots of its node need about "
                "%.0f MiB (%d kept, one more being written%s). Restarts will read storage. Enlarge the tmpfs (e.g. docker --shm-size) "
                "or pass SpotCheckpoint(snapshot_dir=...) a larger one.",
                where,
                have / 2**20,
                need / 2**20,
                KEEP,
                ", with a peer node's copies" if self.peer_copy else "",
            )
            self.enabled = False

    def _write(
        self, step: int, tensors: Any, meta: dict[str, Any], state: dict[str, Any], record: dict[str, Any]
    ) -> None:
        started = time.monotonic()
        data = tensorfile.encode(tensors) if self.peer_copy else None
        self._store(step, self.rank, data if data is not None else tensors, meta, state)
        if data is not None:
            header = json.dumps({"meta": meta, "state": state}).encode()
            got_header, got_data = exchange_bytes(
                [(self.next_peer, 0, header), (self.next_peer, 1, data)],
                [(self.prev_peer, 0), (self.prev_peer, 1)],
                self.group,
            )
            peer = json.loads(got_header)
            self._store(step, self.prev_peer, got_data, peer["meta"], peer["state"])
        self.store.retire([self.rank, self.prev_peer] if data is not None else [self.rank], KEEP)
        if self.rank % self.local_world == 0:
            self.store.prune(KEEP + 1)  # leftovers no rank retires (earlier layouts, killed writers)
        record["write_seconds"] = time.monotonic() - started

    def _store(self, step: int, rank: int, data: Any, meta: dict[str, Any], state: dict[str, Any]) -> None:
        """Write one share; a full or failing tmpfs costs this snapshot (with a warning), not the training."""
        try:
            self.store.write(step, rank, data, meta, state)
        except OSError as err:
            if not self._warned:
                log.warning("lightning-spot: a snapshot of step %d could not be kept in memory: %s", step, err)
                self._warned = True

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def close(self) -> None:
        """Wait for the last snapshot; the node's first rank deletes them (call once training is over)."""
        self.wait()
        if self.group is not None:
            dist.barrier(group=self.group)
        if self.rank % self.local_world == 0:
            self.store.clear()
