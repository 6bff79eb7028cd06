"""``SpotCheckpoint``'s saves: a step's state copied to host memory, then written in the background.

    saver = Saver(async_save=True, io_threads=2, keep_last=3, record=journal.record)
    saver.open(storage, snapshots, group=gloo_group)   # at setup: the tiers this run writes to
    saver.save(trainer, host, reason="periodic")    # collective: every rank copies, then uploads in a thread
    saver.snapshot(trainer, host)                   # this rank's state to host memory (not collective)
    saver.wait(url)                                 # the upload committed; its error raised here
    saver.summary(train_seconds)                    # saves, stall, snapshots between saves

Saving blocks training only while this rank's tensors are copied; one upload runs at a time (a new save first
waits for the previous). With snapshots, a save's copy is that step's snapshot and the upload copies the
snapshot's files. The split and the write are the strategy's ``PipelineCheckpointIO`` (``host.checkpoints``, the I/O
of ``trainer.save_checkpoint`` too). A checkpoint exists once its manifest is written; older ones are deleted (``keep_last``) only
after a newer one is committed. The step's records (stall, bytes, write time, the writer's CPU time) feed the
cadence and the run's summary.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Optional

import lightning as L
import torch.distributed as dist

from lightning_spot.checkpoint.background import start_background
from lightning_spot.checkpoint.durable.from_snapshot import recycle
from lightning_spot.checkpoint.durable.read import CheckpointError
from lightning_spot.checkpoint.durable.storage import Storage, step_dirname, step_of
from lightning_spot.checkpoint.loop_cost import LoopSteps
from lightning_spot.checkpoint.memory.snapshot import SnapshotStore
from lightning_spot.checkpoint.memory.snapshotter import Snapshotter
from lightning_spot.checkpoint.payload import Payload
from lightning_spot.checkpoint.pipeline_io import PipelineCheckpointIO
from lightning_spot.checkpoint.staging import Staging
from lightning_spot.checkpoint.strategy_api import CheckpointHost
from lightning_spot.runtime.clock import Timeline
from lightning_spot.utils.distributed import rank


class Saver:
    """This rank's saves and snapshots (see the module's text)."""

    def __init__(self, *, async_save: bool, io_threads: int, keep_last: int, record: Callable[..., None]) -> None:
        #: the run directory (set by :meth:`open`)
        self.storage: Optional[Storage] = None
        #: the node's snapshot store (``None``: no snapshots)
        self.snapshots: Optional[SnapshotStore] = None
        self.async_save = async_save
        self.io_threads = io_threads
        self.keep_last = keep_last
        #: the gloo group the background uploads agree over (``None``: uploads block)
        self.group: Optional[dist.ProcessGroup] = None
        self._record = record
        #: each save: step, stall, bytes, reason; once written, its write time and the writer's CPU time
        self.saves: list[dict[str, Any]] = []
        self.snapshotter: Optional[Snapshotter] = None
        self.staging = Staging()  # shared with the snapshotter: one set of host buffers (pinned on GPUs)
        self._staging_free = threading.Event()  # cleared while an upload may still read the staging buffers
        self._staging_free.set()
        #: the module's buffers: a forward may change them, so snapshots copy them at once
        self.buffer_names: frozenset[str] = frozenset()
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        #: the step and time of the last save, and the time of the last snapshot (a save is one too)
        self.last_step = -1
        self.last_time = self.last_snapshot_time = time.monotonic()
        #: the loop's step times: what background writes cost it
        self.loop = LoopSteps()

    def open(self, storage: Storage, snapshots: Optional[SnapshotStore], group: Optional[dist.ProcessGroup]) -> None:
        """The tiers of this fit (a later fit keeps the records and opens its own)."""
        self.storage, self.snapshots, self.group = storage, snapshots, group

    def opened(self) -> Storage:
        """The run directory this fit writes to (an error before setup)."""
        if self.storage is None:
            raise RuntimeError("SpotCheckpoint saves only during fit (its storage is opened at setup)")
        return self.storage

    # -------------------------------------------------------------------- save
    def save(self, trainer: L.Trainer, host: CheckpointHost, *, reason: str, blocking: bool = False) -> None:
        """Checkpoint the current step on every rank (collective); ``blocking`` waits until it is committed."""
        self.opened()
        start = time.monotonic()
        self.wait()
        waited = time.monotonic() - start
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        background = self.async_save and not blocking and self.group is not None
        io = host.checkpoints  # the strategy's: trainer.save_checkpoint writes through it too
        info = io.info(checkpoint)
        snapshot: Optional[threading.Thread] = None  # the writer of this step's snapshot
        if self.snapshots is not None:  # the same copy is the step's snapshot: memory stays at least as new as
            self.last_snapshot_time = time.monotonic()  # storage, and the upload copies the snapshot's files
            snapshotter = self._snapshotter(trainer, host)
            copy_start = time.monotonic()
            # into the snapshot's file, or into our staging (free again: the previous save is done)
            payload = snapshotter.copy(checkpoint, info["step"], now=self.buffer_names, aliases=io.aliases)
            snapshotter.take(payload, dict(info), since=copy_start)
            snapshot = snapshotter.thread
            if snapshot is not None:
                self.snapshots.pin(info["step"], rank())  # not recycled before the upload has read it
        else:
            payload = io.split(checkpoint, whole=trainer.is_global_zero, copy=background, staging=self.staging)
        stall = time.monotonic() - start
        info["timings"] = {"stall_seconds": round(stall, 4), "waited_for_previous_seconds": round(waited, 4)}
        info["reason"] = reason
        self.last_step, self.last_time = trainer.global_step, time.monotonic()
        record = {"step": info["step"], "stall_seconds": stall, "waited_seconds": waited, "bytes": payload.nbytes}
        self.saves.append({**record, "reason": reason})
        timeline = _timeline(host)
        if timeline is not None:
            now = time.perf_counter()
            timeline.add("checkpoint copy", "checkpoint", now - stall, now, step=info["step"], reason=reason)
        rel = step_dirname(info["step"])
        if background:
            self._staging_free.clear()
            self._thread = start_background(self._write_in_background, io, rel, payload, info, timeline, snapshot)
        else:  # e.g. before a coordinated stop exits the process: the snapshot is written too
            self._write(io, rel, payload, info, timeline, snapshot)

    def skipped(self, step: int) -> None:
        """A save this pipeline does not write (torchft: another pipeline of the quorum writes the step)."""
        self.last_step, self.last_time = step, time.monotonic()

    def _write(
        self,
        io: PipelineCheckpointIO,
        rel: str,
        payload: Payload,
        info: dict[str, Any],
        timeline: Optional[Timeline] = None,
        snapshot: Optional[threading.Thread] = None,
    ) -> None:
        """Write a checkpoint: the files of this step's snapshot (written by the thread ``snapshot``) when
        every rank has them, else DCP shards."""
        started = time.perf_counter()
        from_snapshot = None
        try:
            changed = False
            if snapshot is not None and self.snapshots is not None:
                snapshot.join()
                from_snapshot = (self.snapshots, info["step"])  # if every rank's payload was written
                changed = self.snapshotter is not None and self.snapshotter.changed(info["step"])
            manifest = io.write(
                self.opened(),
                rel,
                payload,
                info,
                group=self.group,
                thread_count=self.io_threads,
                snapshot=from_snapshot,
                discard=changed,
                release=self._staging_free.set,
            )
        finally:
            self._staging_free.set()
            if snapshot is not None and self.snapshots is not None:
                self.snapshots.unpin(info["step"], rank())
        if timeline is not None:
            timeline.add(
                "checkpoint upload", "checkpoint", started, time.perf_counter(), lane="checkpoint", step=info["step"]
            )
        if manifest is not None:
            self.saves[-1]["write_seconds"] = manifest["timings"]["write_seconds"]
            self._apply_retention(rel)
            self._record(
                "checkpoint",
                step=manifest["step"],
                reason=manifest.get("reason"),
                bytes=manifest["bytes"],
                **manifest["timings"],
            )

    def _write_in_background(self, *args: Any) -> None:
        cpu, record = time.thread_time(), self.saves[-1]
        record["write_started"] = time.monotonic()
        try:
            self._write(*args)
        except BaseException as err:  # surfaced by wait()
            self._error = err
        if "write_seconds" in record:
            record["write_ended"] = time.monotonic()
            record["cpu_seconds"] = time.thread_time() - cpu

    def wait(self) -> None:
        """Block until the background save (if any) is committed; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(f"Saving a checkpoint to {self.opened().url} failed: {err}") from err

    def _apply_retention(self, newest: str) -> None:
        """Keep the last ``keep_last`` committed checkpoints; drop debris of interrupted older saves."""
        storage = self.opened()
        committed = storage.committed()
        for old in committed[: -self.keep_last]:
            recycle(storage, old)  # a local directory keeps its tensor files for the next uploads
            storage.delete(old)
        for name in storage.step_dirs():
            if name not in committed and step_of(name) < step_of(newest):
                storage.delete(name)

    # --------------------------------------------------------------- snapshots
    def snapshot(self, trainer: L.Trainer, host: CheckpointHost) -> None:
        """Keep this rank's state of this step in host memory (written in the background; not collective)."""
        self.last_snapshot_time = time.monotonic()
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        io = host.checkpoints
        snapshotter, info = self._snapshotter(trainer, host), io.info(checkpoint)
        start = time.monotonic()
        # the staging buffers are shared with the durable saves: an upload in progress may still read them (normally
        # it has moved on to the snapshot's files by now)
        self._staging_free.wait()
        payload = snapshotter.copy(checkpoint, info["step"], now=self.buffer_names, aliases=io.aliases)
        stall = snapshotter.take(payload, info, since=start)
        timeline = _timeline(host)
        if timeline is not None and stall:
            now = time.perf_counter()
            timeline.add("snapshot copy", "checkpoint", now - stall, now, step=trainer.global_step)

    def durable_seconds(self) -> Optional[float]:
        """What the newest finished durable save took, its stall and its write (timed on the first rank only), or
        ``None`` before one has finished."""
        done = [s for s in self.saves if "write_seconds" in s]
        return done[-1]["stall_seconds"] + done[-1]["write_seconds"] if done else None

    def snapshot_now(self, trainer: L.Trainer, host: CheckpointHost) -> bool:
        """This step's snapshot, written (with its copy to the next node, where one is made) before this returns;
        whether this rank's share was kept."""
        self.snapshot(trainer, host)
        if self.snapshotter is None or self.snapshots is None:
            return False
        self.snapshotter.wait()
        return self.snapshotter.enabled and self.snapshots.has_share(trainer.global_step, rank())

    def copies_done(self) -> None:
        """Wait until the last snapshot's parameters and optimizer state are copied: before what may change them
        next, the optimizer step, and hooks that write weights between steps (``.data``, which no version counter
        sees): validation's (an average swapped in for it) and the end of training (the average copied in)."""
        if self.snapshotter is not None:
            self.snapshotter.wait_copied()

    @property
    def writing_snapshot(self) -> bool:
        return self.snapshotter is not None and self.snapshotter.writing

    def _snapshotter(self, trainer: L.Trainer, host: CheckpointHost) -> Snapshotter:
        if self.snapshotter is None:
            store = self.snapshots
            assert store is not None
            self.snapshotter = Snapshotter(
                store,
                store.group,
                rank=trainer.global_rank,
                world=trainer.world_size,
                local_world=trainer.num_devices,
                stage_of=host.pipeline_layout.grid.same_state_key,
                staging=self.staging,
            )
        return self.snapshotter

    def clear_snapshots(self, trainer: L.Trainer) -> None:
        """Training is over: free the host memory (each node's first rank, once every rank is done)."""
        if self.snapshotter is not None:
            self.snapshotter.close()
        elif self.snapshots is not None and trainer.local_rank == 0:
            self.snapshots.clear()

    # ------------------------------------------------------------------ figures
    def loop_cost(self, record: dict[str, Any]) -> float:
        """What a finished snapshot or save cost the loop: its stall, plus how much the steps its background write
        overlapped were slower than the steps before (the writer's CPU time where that cannot be measured)."""
        running = []  # the writes still going on (at most one of each kind): their steps are not the usual ones
        if self.writing_snapshot:
            assert self.snapshotter is not None
            running.append(self.snapshotter.taken[-1].get("write_started", time.monotonic()))
        if self._thread is not None and self._thread.is_alive():
            running.append(self.saves[-1].get("write_started", time.monotonic()))
        slower = self.loop.cost(record["write_started"], record["write_ended"], running)
        return record["stall_seconds"] + (record["cpu_seconds"] if slower is None else slower)

    def summary(self, train_seconds: float, final_wait: float) -> dict[str, float]:
        """Checkpoint figures for this rank: saves; the stall (time the training loop was blocked by saves)
        and its fraction of ``train_seconds``; the wait for the last upload after training ended; the snapshots
        taken between saves and their stall."""
        stall = sum(s["stall_seconds"] for s in self.saves)
        saved = {s["step"] for s in self.saves}
        between = [t for t in (self.snapshotter.taken if self.snapshotter else []) if t["step"] not in saved]
        return {
            "snapshots": float(len(between)),
            "snapshot_stall_seconds": sum(t.get("stall_seconds", 0.0) for t in between),
            "snapshot_wait_seconds": sum(t.get("waited_seconds", 0.0) for t in between),
            "saves": float(len(self.saves)),
            "stall_seconds": stall,
            "stall_fraction": stall / train_seconds if train_seconds else 0.0,
            "bytes_per_rank": float(self.saves[-1]["bytes"]) if self.saves else 0.0,
            "final_wait_seconds": final_wait,
        }


def closing_line(summary: dict[str, float], saves: list[dict[str, Any]], url: str, train_seconds: float) -> str:
    """The line that ends a run: its saves, the training stall, the last upload's wait, the snapshots between."""
    s = summary
    line = (
        f"SpotCheckpoint: {s['saves']:.0f} checkpoints to {url}; training stalled {s['stall_seconds']:.2f}s "
        f"({100 * s['stall_fraction']:.2f}% of {train_seconds:.1f}s); the last upload finished "
        f"{s['final_wait_seconds']:.2f}s after training{per_save(saves)}"
    )
    if s["snapshots"]:
        line += (
            f"; {s['snapshots']:.0f} snapshots to host memory between saves stalled it "
            f"{s['snapshot_stall_seconds']:.2f}s more ({s['snapshot_wait_seconds']:.2f}s of it waiting for the "
            "previous snapshot's write)"
        )
    return line


def per_save(saves: list[dict[str, Any]]) -> str:
    """The first save's stall (it allocates the host buffers) and the later ones' median, with the part spent
    waiting for the previous upload (saves closer together than an upload takes)."""
    first = saves[0]
    text = f"; per save: the first {first['stall_seconds']:.2f}s"
    later = sorted(saves[1:], key=lambda s: s["stall_seconds"])
    if later:
        mid = later[len(later) // 2]
        text += f", then a median {mid['stall_seconds']:.2f}s"
        waited = sum(s["waited_seconds"] for s in later)
        if waited >= 0.01:
            text += f" ({waited:.2f}s in all waiting for the previous upload: saves closer than an upload takes)"
    return text


def _timeline(host: CheckpointHost) -> Optional[Timeline]:
    """The pipeline timeline being recorded, if any (``PipelineTimeline``)."""
    clock = host.step_clock
    return clock.timeline if clock is not None else None
