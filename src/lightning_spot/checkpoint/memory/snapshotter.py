"""Take in-memory snapshots: copy on the training thread, write and copy to a peer node in the background.

    snapshotter = Snapshotter(store, group, rank=r, world=w, local_world=lw, pp_rank=p, stage_of=layout.grid.same_state_key)
    snapshotter.take(checkpoint, info)       # a Lightning checkpoint dict of this step; returns the stall
    share = snapshotter.copy(checkpoint, step); snapshotter.take(share, info)   # the same, the copy shared
    snapshotter.wait_copied()                # before the next optimizer step (SpotCheckpoint's hook)
    snapshotter.wait(); snapshotter.close()

The copy goes straight into the share's file in host memory (a spare tensor file of this rank, mapped
into the process: see ``checkpoint.memory.mapped``). Parameters and optimizer state change only when the
optimizer steps, so, as in CheckFreq (FAST'21), the background thread copies them while the next step's
forward and backward run, and the training thread waits for that copy only before the next update
(``wait_copied``); the tensors named ``now`` (buffers, which a forward may change) are copied on the
training thread. Every tensor's version counter is checked after the copy: if one was changed in place
meanwhile, that step's snapshot (and a durable checkpoint made of it) is dropped with a warning, and
later copies are all made on the training thread. The first shares of a run (no spare yet) and tensors
on a GPU are copied into staging buffers on the training thread and written by the background thread.

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
from torch import Tensor

from lightning_spot.checkpoint import model_copies, tensorfile
from lightning_spot.checkpoint.background import start_background
from lightning_spot.checkpoint.memory.snapshot import TENSORS, SnapshotStore, Staged
from lightning_spot.checkpoint.payload import Payload, split_checkpoint
from lightning_spot.checkpoint.staging import Staging
from lightning_spot.utils.distributed import all_gather_object, exchange_bytes

log = logging.getLogger(__name__)

KEEP = 2  # snapshots kept per rank: the newest may be half-written when a node dies
Copy = tuple[str, Tensor, Tensor, int]  # a copy left to the background thread: name, source, target, version


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
        staging: Staging | None = None,
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
        #: reused once the previous snapshot's thread is done with it; SpotCheckpoint shares its own (one set of
        #: pinned buffers per rank on GPUs) and waits for its upload to be done with them too
        self.staging = staging if staging is not None else Staging()
        self.taken: list[dict[str, Any]] = []  # step, stall_seconds, write_seconds, bytes, mapped
        self.thread: threading.Thread | None = None  # the newest snapshot's writer
        #: the newest copy, when it went into a mapped file: the share, its file, the copies left to the thread
        self._staged: tuple[Payload, Staged, list[Copy]] | None = None
        self._copied: threading.Event | None = None  # set once the background thread has made them
        self._waited = 0.0  # how long the newest copy waited for the previous snapshot's thread
        self.defer = True  # copy parameters and optimizer state in the background (off after a change is seen)
        self._warned = False

    def copy(
        self,
        checkpoint: dict[str, Any],
        step: int,
        now: frozenset[str] = frozenset(),
        aliases: dict[str, str] | None = None,
    ) -> Payload:
        """This rank's share of a Lightning checkpoint dict, its tensors copied: into the file of the snapshot
        of ``step`` when a mapped spare is ready (the model tensors named in ``now`` here, the rest by the
        background thread of :meth:`take`), else into the staging buffers. ``aliases``: see ``split_checkpoint``."""
        waiting = time.monotonic()
        self.wait()  # the previous snapshot's thread is done with its files and buffers
        self._waited = time.monotonic() - waiting
        share = split_checkpoint(checkpoint, copy=False, with_lightning=True, aliases=aliases)
        if not self.taken:
            self._check_room(share.nbytes)
        self._staged = None
        on_cpu = all(t.device.type == "cpu" for group in share.tensors.values() for t in group.values())
        staged = None
        if self.enabled and on_cpu:
            staged = self.store.stage(step, self.rank, tensorfile.layout(share.tensors))
        if staged is None:
            share.tensors = {
                g: {n: self.staging.copy(g, n, t) for n, t in named.items()} for g, named in share.tensors.items()
            }
            return share
        pending: list[Copy] = []
        for group, named in share.tensors.items():
            into = staged.tensors[group]
            for name, t in named.items():
                if self.defer and not (name in now and (group == "model" or group.startswith(model_copies.PREFIX))):
                    pending.append((f"{group}/{name}", t, into[name], t._version))
                else:
                    into[name].copy_(t)
        share.tensors = staged.tensors
        self._staged = (share, staged, pending)
        return share

    def wait_copied(self) -> None:
        """Block until the background thread has copied the newest snapshot's parameters and optimizer state
        (call before anything changes them: the optimizer step)."""
        if self._copied is not None:
            self._copied.wait()
            self._copied = None

    def take(self, checkpoint: dict[str, Any] | Payload, info: dict[str, Any], since: float | None = None) -> float:
        """Copy this rank's state of the step (unless given the ``Payload`` that :meth:`copy` made of it, which a
        durable checkpoint of the same step shares); write it (and the peer copy) in the background. Returns
        the stall: from ``since`` (``time.monotonic()`` before that copy) when given."""
        if not self.enabled:
            return 0.0
        start = time.monotonic() if since is None else since
        share = checkpoint if isinstance(checkpoint, Payload) else self.copy(checkpoint, info["step"])
        if not self.enabled:  # the first snapshot found too little memory
            return 0.0
        staged: Staged | None = None
        pending: list[Copy] = []
        if self._staged is not None and self._staged[0] is share:
            _, staged, pending = self._staged
        self._staged = None
        self._copied = threading.Event() if pending else None
        meta = {
            "names": {g: sorted(t) for g, t in share.tensors.items()},
            "layout": info["layout"],
            "pp_rank": self.stage_of(self.rank),
        }
        state = {"rng": share.rng, "optimizer_values": share.optimizer_values, "lightning": share.lightning}
        state["info"] = info
        record: dict[str, Any] = {"step": info["step"], "bytes": share.nbytes, "mapped": staged is not None}
        record["waited_seconds"], self._waited = self._waited, 0.0  # (part of the stall) for the previous write
        self.taken.append(record)
        self.thread = start_background(
            self._write, info["step"], staged or share.tensors, meta, state, record, pending, self._copied
        )
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
        self,
        step: int,
        tensors: Any,
        meta: dict[str, Any],
        state: dict[str, Any],
        record: dict[str, Any],
        pending: list[Copy],
        copied: threading.Event | None,
    ) -> None:
        started, cpu = time.monotonic(), time.thread_time()
        record["write_started"] = started  # the steps it overlaps are not a clean baseline for other writes
        try:
            changed = ""
            if name := _finish_copies(pending):
                changed = f"{name} changed in place between the save and the next optimizer step, before it was copied"
        except Exception as err:  # the share holds a partial copy: dropped like a changed one
            changed = f"its background copy failed ({type(err).__name__}: {err})"
        finally:
            if copied is not None:
                copied.set()
        if changed:
            self._drop_changed(step, tensors, changed, record)
        data = None
        if self.peer_copy and not changed:
            data = bytes(tensors.mapped.buffer) if isinstance(tensors, Staged) else tensorfile.encode(tensors)
        written = not changed and self._store(step, self.rank, tensors, meta, state)
        if self.peer_copy:  # both ways even when this share was dropped: the peers wait for each other
            header = json.dumps({"meta": meta, "state": state, "dropped": bool(changed)}).encode()
            got_header, got_data = exchange_bytes(
                [(self.next_peer, 0, header), (self.next_peer, 1, data or b"\0")],
                [(self.prev_peer, 0), (self.prev_peer, 1)],
                self.group,
            )
            peer = json.loads(got_header)
            if not peer["dropped"]:
                self._store(step, self.prev_peer, got_data, peer["meta"], peer["state"])
        if changed:
            return
        self.store.retire([self.rank, self.prev_peer] if self.peer_copy else [self.rank], KEEP)
        if self.rank % self.local_world == 0:
            self.store.prune(KEEP + 1)  # leftovers no rank retires (earlier layouts, killed writers)
        if written:  # the next copy goes straight into a mapped file of this size
            self.store.prepare(self.rank, self.store.share_path(step, self.rank, TENSORS).stat().st_size)
        record["write_ended"] = time.monotonic()
        record["write_seconds"] = record["write_ended"] - started
        record["cpu_seconds"] = time.thread_time() - cpu

    def _drop_changed(self, step: int, staged: Any, why: str, record: dict[str, Any]) -> None:
        """The background copy of ``step`` is not that step's state (``why``): its share is not written, and from
        now on every copy is made on the training thread."""
        record["changed"] = why
        self.defer = False
        if isinstance(staged, Staged):
            staged.path.unlink(missing_ok=True)
        log.warning(
            "lightning-spot: the snapshot of step %d is dropped: %s. A durable checkpoint of that step is not "
            "written either; the state is copied on the training thread from now on.",
            step,
            why,
        )

    def changed(self, step: int) -> bool:
        """Whether the snapshot of ``step`` was dropped because its state changed while being copied (call
        after its thread is done)."""
        return any(t["step"] == step and "changed" in t for t in self.taken)

    def _store(self, step: int, rank: int, data: Any, meta: dict[str, Any], state: dict[str, Any]) -> bool:
        """Write one share; a full or failing tmpfs costs this snapshot (with a warning), not the training."""
        try:
            self.store.write(step, rank, data, meta, state)
            return True
        except OSError as err:
            if isinstance(data, Staged):
                data.path.unlink(missing_ok=True)
            if not self._warned:
                log.warning("lightning-spot: a snapshot of step %d could not be kept in memory: %s", step, err)
                self._warned = True
            return False

    @property
    def writing(self) -> bool:
        """Whether the newest snapshot is still being written (a copy now would wait for it)."""
        return self.thread is not None and self.thread.is_alive()

    def wait(self) -> None:
        self.wait_copied()
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def close(self) -> None:
        """Wait for the last snapshot; the node's first rank deletes them (call once training is over)."""
        self.wait()
        self.store.maps.close()
        if self.group is not None:
            dist.barrier(group=self.group)
        if self.rank % self.local_world == 0:
            self.store.clear()


def _finish_copies(pending: list[Copy]) -> str:
    """Make the copies ``(name, source, target, source version)``; the name of a source that changed in place
    since its version was taken (the copy may hold a later value), or ``""``."""
    for _, source, target, _ in pending:
        target.copy_(source)
    return next((name for name, source, _, version in pending if source._version != version), "")
