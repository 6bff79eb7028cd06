"""``SpotCheckpoint``: sharded checkpoints in object storage that survive preemption and layout changes.

    ckpt = SpotCheckpoint(dirpath="s3://my-bucket/runs/gpt", every_n_train_steps=200, keep_last=3)
    trainer = L.Trainer(strategy=SpotPipelineStrategy(), callbacks=[ckpt], max_steps=100_000)
    trainer.fit(model, dm)      # the same command after a preemption resumes from the latest checkpoint

Saving blocks training only while this rank's tensors are copied to host memory; the upload runs
in a background thread (one save at a time: a new one first waits for the previous). A checkpoint
exists once its manifest is written; older ones are deleted only after a newer one is committed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Optional, Union

import lightning as L
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_spot.checkpoint.background import start_background
from lightning_spot.checkpoint.cadence import Cadence
from lightning_spot.checkpoint.durable.journal import (
    PIPELINE_HISTORY,
    Journal,
    interruption_history,
    read_events,
    summarize,
)
from lightning_spot.checkpoint.durable.read import CheckpointError
from lightning_spot.checkpoint.durable.shares import clear_spares, recycle
from lightning_spot.checkpoint.durable.storage import Storage, StorageError, step_dirname, step_of
from lightning_spot.checkpoint.durable.write import write_checkpoint
from lightning_spot.checkpoint.host import CheckpointHost, is_checkpoint_host
from lightning_spot.checkpoint.loop_cost import LoopSteps
from lightning_spot.checkpoint.memory.snapshot import SNAPSHOT_SCHEME, SnapshotError, SnapshotStore
from lightning_spot.checkpoint.memory.snapshotter import Snapshotter
from lightning_spot.checkpoint.payload import split_checkpoint
from lightning_spot.checkpoint.staging import Staging
from lightning_spot.checkpoint.step_policy import Agreed, StepPolicy
from lightning_spot.preemption.coordinate import AgreementCadence, PostedMax
from lightning_spot.preemption.lightning_sigterm import take_over_sigterm
from lightning_spot.preemption.stop import PreemptionStop, stop_for_preemption
from lightning_spot.preemption.watcher import PreemptionWatcher
from lightning_spot.runtime.clock import Timeline
from lightning_spot.runtime.process import process_started
from lightning_spot.utils.distributed import all_gather_object, broadcast_object, is_initialized, rank

log = logging.getLogger(__name__)


class SpotCheckpoint(L.Callback):
    """Save sharded checkpoints to any fsspec URL and resume from the latest one, on any layout.

    Args:
        dirpath: run directory, any fsspec URL (``s3://bucket/run``, ``gs://...``, ``file://...`` or a
            path). Default: ``<trainer.default_root_dir>/spot_checkpoints``.
        every_n_train_steps: save every N optimizer steps.
        every_n_minutes: save when this much wall time has passed since the last save (agreed by all ranks).
            Without either: durable saves at the Young-Daly interval from their measured cost and this run's
            interruption rate in its history (``checkpoint/cadence.py``), re-evaluated as the run goes.
        save_on_train_end: save when training ends (also after ``max_steps``).
        keep_last: number of committed checkpoints to keep.
        resume: when ``fit`` is called without ``ckpt_path``, resume from the latest intact checkpoint.
        storage_options: passed to fsspec (e.g. ``{"endpoint_url": ..., "key": ..., "secret": ...}`` for s3fs).
        async_save: upload in a background thread (training stalls only for the copy to host memory).
        io_threads: files written (and uploaded) in parallel per rank.
        preemption: watch for preemption notices (``True``: SIGTERM and, if detected, the cloud's
            spot notices; or a configured :class:`PreemptionWatcher`; ``False``: off). A notice on any
            rank makes all ranks checkpoint the current step and exit with ``PREEMPTED_EXIT_CODE`` (75),
            which makes torchrun restart the group.
        heartbeat_seconds: how often rank 0 records progress in the run history (for the report of
            time lost after a crash).
        snapshots: keep every rank's state in host memory too (default); durable checkpoints are then made from
            the snapshot files. Without a snapshot interval, snapshots are taken as often as 1% of the loop's time
            allows (their cost is measured). A host without a usable tmpfs runs without them (with a warning).
        snapshot_every_n_train_steps: keep every rank's state in host memory every N steps (a tmpfs that
            outlives the worker processes): a restart of the workers (torchrun restarts every worker of a node
            when one fails) resumes from there, when it is newer than the newest checkpoint in storage.
        snapshot_every_n_seconds: also (or instead) snapshot when this many seconds have passed since the
            last snapshot (the ranks agree, as for ``every_n_minutes``).
        snapshot_dir: where snapshots live (default ``/dev/shm/lightning-spot``); the newest two are kept and
            they are deleted when training ends.
    """

    def __init__(
        self,
        dirpath: Optional[str] = None,
        *,
        every_n_train_steps: Optional[int] = None,
        every_n_minutes: Optional[float] = None,
        save_on_train_end: bool = True,
        keep_last: int = 3,
        resume: bool = True,
        storage_options: Optional[dict[str, Any]] = None,
        async_save: bool = True,
        io_threads: int = 2,
        preemption: Union[bool, PreemptionWatcher] = True,
        heartbeat_seconds: float = 30.0,
        snapshots: bool = True,
        snapshot_every_n_train_steps: Optional[int] = None,
        snapshot_every_n_seconds: Optional[float] = None,
        snapshot_dir: Optional[str] = None,
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        if every_n_train_steps is not None and every_n_train_steps < 1:
            raise ValueError(f"every_n_train_steps must be >= 1, got {every_n_train_steps}")
        if every_n_minutes is not None and every_n_minutes <= 0:
            raise ValueError(f"every_n_minutes must be > 0, got {every_n_minutes}")
        self.dirpath = dirpath
        self.every_n_train_steps = every_n_train_steps
        self.every_n_minutes = every_n_minutes
        self.save_on_train_end = save_on_train_end
        self.keep_last = keep_last
        self.resume = resume
        self.storage_options = dict(storage_options or {})
        self.async_save = async_save
        self.io_threads = io_threads
        self.preemption = preemption
        self.heartbeat_seconds = heartbeat_seconds
        if snapshot_every_n_train_steps is not None and snapshot_every_n_train_steps < 1:
            raise ValueError(f"snapshot_every_n_train_steps must be >= 1, got {snapshot_every_n_train_steps}")
        if snapshot_every_n_seconds is not None and snapshot_every_n_seconds <= 0:
            raise ValueError(f"snapshot_every_n_seconds must be > 0, got {snapshot_every_n_seconds}")
        if not snapshots and (snapshot_every_n_train_steps or snapshot_every_n_seconds):
            asked = "snapshot_every_n_train_steps" if snapshot_every_n_train_steps else "snapshot_every_n_seconds"
            raise ValueError(
                f"SpotCheckpoint(snapshots=False, {asked}=...) asks for no snapshots and for snapshots at an interval: "
                f"drop {asked} to train without snapshots, or snapshots=False to take them at that interval."
            )
        self.snapshot_every_n_train_steps = snapshot_every_n_train_steps
        self.snapshot_every_n_seconds = snapshot_every_n_seconds
        #: snapshots asked for by an interval (their absence is an error) or by default (a warning)
        self._snapshots_explicit = bool(snapshot_every_n_train_steps or snapshot_every_n_seconds)
        self.cadence = Cadence(
            snapshot_steps=snapshot_every_n_train_steps,
            snapshot_seconds=snapshot_every_n_seconds,
            durable_steps=every_n_train_steps,
            durable_minutes=every_n_minutes,
            snapshots=snapshots,
        )
        #: how many snapshot and save records the cadence has been given (each is timed once its writing is over)
        self._snapshots_observed = self._saves_observed = 0
        self._said_intervals: tuple[Optional[float], Optional[float]] = (None, None)
        self._last_snapshot_time = time.monotonic()
        self.snapshot_dir = snapshot_dir
        self.snapshots: Optional[SnapshotStore] = None
        self.snapshotter: Optional[Snapshotter] = None
        self.watcher: Optional[PreemptionWatcher] = None
        self.journal: Optional[Journal] = None
        self.report: dict[str, Any] = {}
        self.storage: Optional[Storage] = None
        self.saves: list[dict[str, Any]] = []
        self._group: Optional[dist.ProcessGroup] = None
        self._staging = Staging()  # shared with the snapshotter: one set of host buffers (pinned on GPUs)
        self._staging_free = threading.Event()  # cleared while an upload may still read the staging buffers
        self._staging_free.set()
        self._buffer_names: frozenset[str] = frozenset()
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._last_step = -1
        self._checked_step = -1
        self._loop = LoopSteps()  # the loop's step times: what background writes cost it
        #: the step's agreement, posted at its start (see :meth:`_post_agreement`) on the boundaries of the cadence
        self._agreement: Optional[PostedMax] = None
        self._agreement_cadence = AgreementCadence()
        self._last_time = time.monotonic()
        self._train_start = 0.0
        self._train_seconds = 0.0
        self._trainer: Optional[L.Trainer] = None
        self._original_resume_start: Any = None
        self._undo_sigterm: Callable[[], None] = lambda: None
        self._first_step_seen = False
        self._last_heartbeat = 0.0
        self._final_wait = 0.0

    @property
    def state_key(self) -> str:
        return "SpotCheckpoint"

    @property
    def url(self) -> str:
        if self.storage is None:
            raise RuntimeError("SpotCheckpoint is set up when fit starts")
        return self.storage.url

    # ------------------------------------------------------------------- setup
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != TrainerFn.FITTING.value:
            return
        host = _host(trainer)
        url = broadcast_object(self.dirpath or os.path.join(trainer.default_root_dir, "spot_checkpoints"))
        if host.replica_group_id is not None and self.cadence.snapshots:
            rank_zero_info("SpotCheckpoint: no snapshots in host memory: the other pipelines hold this one's state")
            self.cadence.snapshots = False
        self.snapshots = self._snapshot_store(url) if self.cadence.snapshots else None
        #: the per-step decision (its settings as they stand now that the snapshot store is open or not)
        self.policy = StepPolicy(
            self.every_n_train_steps,
            self.snapshot_every_n_train_steps,
            snapshots=self.snapshots is not None,
            save_on_train_end=self.save_on_train_end,
        )
        if self.snapshots is not None and is_initialized() and self.snapshots.group is None:
            self.snapshots.group = dist.new_group(backend="gloo")  # snapshot traffic, off the training group
        host.use_checkpoint_storage(self.storage_options, url, self.snapshots)
        self.storage = Storage(url, self.storage_options)
        problem = None
        try:
            self.storage.check_access()
        except StorageError as err:
            problem = str(err)
        first = next((p for p in all_gather_object(problem) if p), None)
        if first and self.snapshots is None:
            raise StorageError(first)
        if first:  # a restart during a storage outage can still resume from host memory
            log.warning("lightning-spot: %s; continuing with in-memory snapshots, durable saves may fail", first)
        if self.async_save and is_initialized() and self._group is None:
            self._group = dist.new_group(backend="gloo")
        self._trainer = trainer
        self._install_resume(trainer)
        self._last_time = time.monotonic()
        if self.preemption and self.watcher is None:
            self.watcher = self.preemption if isinstance(self.preemption, PreemptionWatcher) else PreemptionWatcher()
        if self.journal is None:  # torchft: each pipeline's own history (its restarts, the quorums it saw)
            group = host.replica_group_id
            history = (
                self.storage
                if group is None
                else Storage(f"{url.rstrip('/')}/{PIPELINE_HISTORY}{group}", self.storage_options)
            )
            self.journal = Journal(history, enabled=trainer.is_global_zero)

    def _snapshot_store(self, url: str) -> Optional[SnapshotStore]:
        """The node's snapshot store; a missing or read-only tmpfs fails here, before training, when snapshots were
        asked for by an interval, and turns them off (every rank alike) when they are on by default."""
        store = SnapshotStore.for_run(url, self.snapshot_dir)
        problem = None
        try:
            store.check()
        except SnapshotError as err:
            if self._snapshots_explicit:
                raise
            problem = str(err)
        first = next((p for p in all_gather_object(problem) if p), None)
        if first is None:
            return store
        log.warning("lightning-spot: running without snapshots in host memory: %s", first)
        self.cadence.snapshots = False
        return None

    def _install_resume(self, trainer: L.Trainer) -> None:
        """When fit is called without ckpt_path, make Lightning restore the run's latest checkpoint.

        Lightning resolves ``ckpt_path`` before callbacks run; its checkpoint connector's
        ``resume_start`` is where that path is used, so the default is filled in there.
        """
        connector = trainer._checkpoint_connector
        if self._original_resume_start is not None:
            return
        original = connector.resume_start
        self._original_resume_start = original

        def resume_start(checkpoint_path: Any = None, weights_only: Any = None) -> None:
            if not checkpoint_path and self.resume and trainer.state.fn == TrainerFn.FITTING:
                storage = self.storage
                assert storage is not None
                found = self._committed_for_resume(trainer)
                in_memory, why = _host(trainer).newest_snapshot() if self.snapshots is not None else (None, "")
                newest_stored = step_of(found[-1]) if found else -1
                if in_memory is not None and in_memory >= newest_stored:
                    rank_zero_info(
                        f"SpotCheckpoint: resuming from the in-memory snapshot of step {in_memory} (the newest "
                        f"checkpoint in {storage.url} is {'of step ' + str(newest_stored) if found else 'none'})"
                    )
                    checkpoint_path = f"{SNAPSHOT_SCHEME}{in_memory}"
                elif found:
                    if self.snapshots is not None:
                        reason = f"it is older (step {in_memory})" if in_memory is not None else why
                        rank_zero_info(f"SpotCheckpoint: not resuming from memory: {reason}")
                    rank_zero_info(f"SpotCheckpoint: resuming from {storage.url} ({len(found)} committed checkpoints)")
                    checkpoint_path = storage.url
            original(checkpoint_path, weights_only)

        connector.resume_start = resume_start  # type: ignore[method-assign]

    def _committed_for_resume(self, trainer: L.Trainer) -> list[str]:
        """The run's committed checkpoints; with snapshots, unreachable storage reads as none (with a warning)."""
        assert self.storage is not None
        found, problem = None, None
        if trainer.is_global_zero:
            try:
                found = self.storage.committed()
            except Exception as err:  # unreachable storage: memory may still hold the state
                if self.snapshots is None:
                    raise
                problem = f"{type(err).__name__}: {err}"
        found, problem = broadcast_object((found, problem))
        if problem:
            log.warning("lightning-spot: cannot list checkpoints in %s (%s); trying host memory", self.url, problem)
        return found or []

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        try:
            self.wait()
        finally:
            if self.watcher is not None:
                self.watcher.stop()
                self._undo_sigterm()
            if self.journal is not None:
                self.journal.close()
                self.journal = None
            if self._original_resume_start is not None:
                trainer._checkpoint_connector.resume_start = self._original_resume_start  # type: ignore[method-assign]
                self._original_resume_start = None

    def state_dict(self) -> dict[str, Any]:
        return {}

    # ------------------------------------------------------------------- hooks
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._train_start = self._last_snapshot_time = self._last_time = time.monotonic()
        # a forward may change buffers: snapshots copy them at once, the rest before the next optimizer step
        self._buffer_names = frozenset(name for name, _ in pl_module.named_buffers())
        self._last_step = self._checked_step = trainer.global_step
        self._loop = LoopSteps()
        self._agreement, self._agreement_cadence = None, AgreementCadence()
        if self.watcher is not None:
            self.watcher.start()
            self._undo_sigterm = take_over_sigterm(trainer, self.watcher)  # its notices are agreed per step below
        host = _host(trainer)
        restored = host.restored_manifest
        if self.snapshots is not None and trainer.local_rank == 0:
            self.snapshots.drop_after(trainer.global_step)  # newer ones belong to the attempt that failed
        if self.cadence.auto_durable:
            self.cadence.set_history(*broadcast_object(self._history() if trainer.is_global_zero else None))
        assert self.journal is not None
        self.journal.record(
            "start",
            step=trainer.global_step,
            resumed_step=restored["step"] if restored else None,
            resumed_from=restored.get("tier") if restored else None,
            restore_seconds=round(restored["restore_seconds"], 3)
            if restored and "restore_seconds" in restored
            else None,
            layout=host.pipeline_layout.to_dict(),
            restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
            process_started=round(process_started(), 3),
        )

    def _history(self) -> tuple[float, int]:
        """This run's running time and interruptions so far (rank 0; unreadable history: none)."""
        assert self.storage is not None
        try:
            return interruption_history(self.journal.storage if self.journal is not None else self.storage)
        except Exception as err:
            log.warning(
                "lightning-spot: cannot read the run history of %s (%s); assuming no interruption", self.url, err
            )
            return 0.0, 0

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self._copies_done()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._copies_done()  # (an average swapped in for validation, in the hooks that follow this one)

    def _copies_done(self) -> None:
        """Wait until the last snapshot's parameters and optimizer state are copied: before what may change them
        next, the optimizer step, and hooks that write weights between steps (``.data``, which no version counter
        sees): validation's (an average swapped in for it) and the end of training (the average copied in)."""
        if self.snapshotter is not None:
            self.snapshotter.wait_copied()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        # read at the step's end: no rank waits for the others at its start
        if self._agreement is None and self._agreement_cadence.due():
            self._agreement = self._post_agreement(trainer)

    def _post_agreement(self, trainer: L.Trainer) -> Optional[PostedMax]:
        """Post this rank's notice, times since the last saves and intervals, and the cadence's proposal: every rank
        decides alike on the largest values (clocks and measured costs differ between ranks)."""
        snap_every, durable_every = self.cadence.snapshot_every(), self.cadence.durable_every()
        if snap_every is None and durable_every is None and self.watcher is None:
            return None
        now = time.monotonic()
        notice = self.watcher.notice if self.watcher is not None else None
        writing = self.snapshotter is not None and self.snapshotter.writing
        values = [notice is not None, now - self._last_snapshot_time, snap_every or 0.0, now - self._last_time]
        return self._agreement_cadence.post([*values, durable_every or 0.0, writing], trainer.strategy.root_device)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step == self._checked_step:  # only at optimizer-step boundaries (not inside an accumulation window)
            return
        self._checked_step = step
        self._loop.step_ended(time.monotonic())
        try:
            self._at_step_end(trainer, step)
        finally:
            self._loop.back_to_training(time.monotonic())

    def _at_step_end(self, trainer: L.Trainer, step: int) -> None:
        self._record_progress(trainer)
        self._observe_costs(trainer)
        posted, self._agreement = self._agreement, None
        agreed = Agreed.of(self._agreement_cadence.read(posted)) if posted is not None else None
        ending = (trainer.max_steps not in (None, -1) and step >= trainer.max_steps) or trainer.should_stop
        decision = self.policy.decide(step, agreed, ending=ending)
        if decision.stop_for_notice:
            stop_for_preemption(
                self.watcher.notice if self.watcher is not None else None,
                step=trainer.global_step,
                save=lambda reason: self.save(trainer, reason=reason, blocking=True),
                report=lambda stop: self._preempted(trainer, stop),
            )
        if decision.save is not None:
            self.save(trainer, reason=decision.save)
        elif decision.snapshot:
            self.snapshot(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._copies_done()  # (before on_train_end's hooks: an average copied into the model)
        last_epoch = trainer.max_epochs not in (None, -1) and trainer.current_epoch + 1 >= trainer.max_epochs
        if self.save_on_train_end and last_epoch and trainer.global_step != self._last_step:
            self.save(trainer, reason="end")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.save_on_train_end and trainer.global_step != self._last_step:
            # stopped by something else (max_time, a callback): the loops are already wound up, so a resume
            # from this checkpoint starts the next epoch
            self.save(trainer, reason="end", blocking=True)
        self._train_seconds = time.monotonic() - self._train_start
        waited = time.monotonic()
        self.wait()  # the last upload: training is over, but the run is not done until it is committed
        self._final_wait = time.monotonic() - waited
        if trainer.is_global_zero and self.storage is not None:
            clear_spares(self.storage)  # every upload is committed
        assert self.journal is not None
        self.journal.record("end", step=trainer.global_step)
        self._report(trainer)
        self._clear_snapshots(trainer)
        if self.saves and trainer.is_global_zero:
            s = self.summary()
            rank_zero_info(
                f"SpotCheckpoint: {s['saves']:.0f} checkpoints to {self.url}; training stalled {s['stall_seconds']:.2f}s "
                f"({100 * s['stall_fraction']:.2f}% of {self._train_seconds:.1f}s); the last upload finished "
                f"{s['final_wait_seconds']:.2f}s after training{_per_save(self.saves)}"
                + (
                    f"; {s['snapshots']:.0f} snapshots to host memory between saves stalled it "
                    f"{s['snapshot_stall_seconds']:.2f}s more ({s['snapshot_wait_seconds']:.2f}s of it waiting for the "
                    "previous snapshot's write)"
                    if s["snapshots"]
                    else ""
                )
            )

    # -------------------------------------------------------------------- save
    def save(self, trainer: L.Trainer, *, reason: str = "on demand", blocking: bool = False) -> None:
        """Checkpoint the current step on every rank (collective); ``blocking`` waits until it is committed."""
        if self.storage is None:
            raise RuntimeError("SpotCheckpoint.save() can only run during fit")
        if not _host(trainer).writes_checkpoints:  # torchft: another pipeline of the quorum writes this step
            self._last_step, self._last_time = trainer.global_step, time.monotonic()
            return
        start = time.monotonic()
        self.wait()
        waited = time.monotonic() - start
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        background = self.async_save and not blocking and self._group is not None
        host = _host(trainer)
        info = host.checkpoint_info(checkpoint)
        snapshot: Optional[threading.Thread] = None  # the writer of this step's snapshot
        if self.snapshots is not None:  # the same copy is the step's snapshot: memory stays at least as new as
            self._last_snapshot_time = time.monotonic()  # storage, and the upload copies the snapshot's files
            snapshotter = self._snapshotter(trainer)
            copy_start = time.monotonic()
            # into the snapshot's file, or into our staging (free again: the previous save is done)
            share = snapshotter.copy(checkpoint, info["step"], now=self._buffer_names, aliases=host.tied_aliases)
            snapshotter.take(share, dict(info), since=copy_start)
            snapshot = snapshotter.thread
            if snapshot is not None:
                self.snapshots.pin(info["step"], rank())  # not recycled before the upload has read it
        else:
            share = split_checkpoint(
                checkpoint,
                copy=background,
                with_lightning=trainer.is_global_zero,
                staging=self._staging,
                aliases=host.tied_aliases,
            )
        stall = time.monotonic() - start
        info["timings"] = {"stall_seconds": round(stall, 4), "waited_for_previous_seconds": round(waited, 4)}
        info["reason"] = reason
        rel = step_dirname(info["step"])
        self._last_step = trainer.global_step
        self._last_time = time.monotonic()
        self.saves.append(
            {
                "step": info["step"],
                "stall_seconds": stall,
                "waited_seconds": waited,
                "bytes": share.nbytes,
                "reason": reason,
            }
        )
        timeline = _timeline(trainer)
        if timeline is not None:
            now = time.perf_counter()
            timeline.add("checkpoint copy", "checkpoint", now - stall, now, step=info["step"], reason=reason)
        if background:
            self._staging_free.clear()
            self._thread = start_background(self._write_in_background, rel, share, info, timeline, snapshot)
        else:  # e.g. before a coordinated stop exits the process: the snapshot is written too
            self._write(rel, share, info, timeline, snapshot)

    def _write(
        self,
        rel: str,
        share: Any,
        info: dict[str, Any],
        timeline: Optional[Timeline] = None,
        snapshot: Optional[threading.Thread] = None,
    ) -> None:
        """Write a checkpoint: the files of this step's snapshot (written by the thread ``snapshot``) when
        every rank has them, else DCP shards."""
        assert self.storage is not None
        started = time.perf_counter()
        from_snapshot = None
        try:
            changed = False
            if snapshot is not None and self.snapshots is not None:
                snapshot.join()
                from_snapshot = (self.snapshots, info["step"])  # if every rank's share was written
                changed = self.snapshotter is not None and self.snapshotter.changed(info["step"])
            manifest = write_checkpoint(
                self.storage,
                rel,
                share,
                info=info,
                group=self._group,
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
            if self.journal is not None:
                self.journal.record(
                    "checkpoint",
                    step=manifest["step"],
                    reason=manifest.get("reason"),
                    bytes=manifest["bytes"],
                    **manifest["timings"],
                )

    def _write_in_background(
        self,
        rel: str,
        share: Any,
        info: dict[str, Any],
        timeline: Optional[Timeline],
        snapshot: Optional[threading.Thread],
    ) -> None:
        cpu, record = time.thread_time(), self.saves[-1]
        record["write_started"] = time.monotonic()
        try:
            self._write(rel, share, info, timeline, snapshot)
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
            raise CheckpointError(f"Saving a checkpoint to {self.url} failed: {err}") from err

    def _apply_retention(self, newest: str) -> None:
        """Keep the last ``keep_last`` committed checkpoints; drop debris of interrupted older saves."""
        assert self.storage is not None
        committed = self.storage.committed()
        for old in committed[: -self.keep_last]:
            recycle(self.storage, old)  # a local directory keeps its tensor files for the next uploads
            self.storage.delete(old)
        for name in self.storage.step_dirs():
            if name not in committed and step_of(name) < step_of(newest):
                self.storage.delete(name)

    # -------------------------------------------------------------- snapshots
    def _observe_costs(self, trainer: L.Trainer) -> None:
        """Feed newly finished snapshots and saves to the cadence; say the intervals when they change."""
        snapshots, self._snapshots_observed = _finished(
            self.snapshotter.taken if self.snapshotter is not None else [], self._snapshots_observed
        )
        saves, self._saves_observed = _finished(self.saves, self._saves_observed)
        for record in snapshots:
            self.cadence.observe_snapshot(self._loop_cost(record), record["write_seconds"])
        for record in saves:
            self.cadence.observe_durable(self._loop_cost(record), record["write_seconds"])
        if not (snapshots or saves):
            return  # the intervals move only with new measurements
        intervals = self.cadence.worth_saying(self._said_intervals)
        if intervals is not None:
            self._said_intervals = intervals
            rank_zero_info(f"SpotCheckpoint: {self.cadence.describe()}")
            if self.journal is not None:
                self.journal.record("cadence", step=trainer.global_step, **self.cadence.chosen())

    def _loop_cost(self, record: dict[str, Any]) -> float:
        """What a finished snapshot or save cost the loop: its stall, plus how much the steps its background write
        overlapped were slower than the steps before (the writer's CPU time where that cannot be measured)."""
        running = []  # the writes still going on (at most one of each kind): their steps are not the usual ones
        if self.snapshotter is not None and self.snapshotter.writing:
            running.append(self.snapshotter.taken[-1].get("write_started", time.monotonic()))
        if self._thread is not None and self._thread.is_alive():
            running.append(self.saves[-1].get("write_started", time.monotonic()))
        slower = self._loop.cost(record["write_started"], record["write_ended"], running)
        return record["stall_seconds"] + (record["cpu_seconds"] if slower is None else slower)

    def snapshot(self, trainer: L.Trainer) -> None:
        """Keep this rank's state of this step in host memory (written in the background; not collective)."""
        self._last_snapshot_time = time.monotonic()
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        snapshotter, info = self._snapshotter(trainer), _host(trainer).checkpoint_info(checkpoint)
        start = time.monotonic()
        # the staging buffers are shared with the durable saves: an upload in progress may still read them (normally
        # it has moved on to the snapshot's files by now)
        self._staging_free.wait()
        share = snapshotter.copy(checkpoint, info["step"], now=self._buffer_names, aliases=_host(trainer).tied_aliases)
        stall = snapshotter.take(share, info, since=start)
        timeline = _timeline(trainer)
        if timeline is not None and stall:
            now = time.perf_counter()
            timeline.add("snapshot copy", "checkpoint", now - stall, now, step=trainer.global_step)

    def _snapshotter(self, trainer: L.Trainer) -> Snapshotter:
        if self.snapshotter is None:
            store = self.snapshots
            assert store is not None
            self.snapshotter = Snapshotter(
                store,
                store.group,
                rank=trainer.global_rank,
                world=trainer.world_size,
                local_world=trainer.num_devices,
                stage_of=_host(trainer).pipeline_layout.grid.same_state_key,
                staging=self._staging,
            )
        return self.snapshotter

    def _clear_snapshots(self, trainer: L.Trainer) -> None:
        """Training is over: free the host memory (each node's first rank, once every rank is done)."""
        if self.snapshotter is not None:
            self.snapshotter.close()
        elif self.snapshots is not None and trainer.local_rank == 0:
            self.snapshots.clear()

    # -------------------------------------------------------------- preemption
    def _preempted(self, trainer: L.Trainer, stop: PreemptionStop) -> None:
        """Record a coordinated stop (its checkpoint is committed; the process exits next)."""
        timeline = _timeline(trainer)
        if timeline is not None:
            now = time.perf_counter()
            timeline.add("preemption stop", "preemption", now - stop.save_seconds, now, source=stop.notice.source)
        rank_zero_info(f"SpotCheckpoint: {stop.describe()}")
        if self.journal is not None:
            self.journal.record("preempted", **stop.event())
            self.journal.close()

    # ----------------------------------------------------------------- history
    def _record_progress(self, trainer: L.Trainer) -> None:
        assert self.journal is not None
        for event in _host(trainer).fault_events():
            self.journal.record(**event)
        batch = _host(trainer).last_global_batch
        if not self._first_step_seen:
            self._first_step_seen = True
            self.journal.record("first_step", step=trainer.global_step, global_batch=batch)
        elif time.monotonic() - self._last_heartbeat >= self.heartbeat_seconds:
            self.journal.record("progress", step=trainer.global_step, global_batch=batch)
        else:
            return
        self._last_heartbeat = time.monotonic()

    def _report(self, trainer: L.Trainer) -> None:
        """Preemptions survived, steps recomputed, time lost and checkpoint stall: printed and logged."""
        if not trainer.is_global_zero:
            return
        assert self.journal is not None and self.storage is not None
        self.journal.flush()
        self.report = summarize(read_events(self.journal.storage))
        own = self.summary()
        self.report["checkpoint_stall_fraction"] = own["stall_fraction"]
        metrics = {
            "spot/preemptions_survived": float(self.report["preemptions_survived"]),
            "spot/steps_recomputed": float(self.report["steps_recomputed"]),
            "spot/time_lost_seconds": float(self.report["time_lost_seconds"]),
            "spot/checkpoint_stall_fraction": float(own["stall_fraction"]),
        }
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        lines = [
            f"SpotCheckpoint report for {self.url}: {self.report['preemptions_survived']} restart(s) survived, "
            f"{self.report['steps_recomputed']} step(s) recomputed, {self.report['time_lost_seconds']:.1f}s lost to restarts"
        ]
        for r in self.report["restarts"]:
            lines.append(
                f"  {r['cause']}: stopped at step {r['stopped_at_step']}, resumed from step {r['resumed_from_step']}, "
                f"{r['time_lost_seconds']:.1f}s lost"
            )
        rank_zero_info("\n".join(lines))

    # ----------------------------------------------------------------- figures
    def summary(self) -> dict[str, float]:
        """Checkpoint figures for this rank: saves; the stall (time the training loop was blocked by saves)
        and its fraction of training time; the wait for the last upload after training ended; the snapshots taken
        between saves and their stall."""
        stall = sum(s["stall_seconds"] for s in self.saves)
        trained = self._train_seconds or max(time.monotonic() - self._train_start, 1e-9)
        saved = {s["step"] for s in self.saves}
        between = [t for t in (self.snapshotter.taken if self.snapshotter else []) if t["step"] not in saved]
        return {
            "snapshots": float(len(between)),
            "snapshot_stall_seconds": sum(t.get("stall_seconds", 0.0) for t in between),
            "snapshot_wait_seconds": sum(t.get("waited_seconds", 0.0) for t in between),
            "saves": float(len(self.saves)),
            "stall_seconds": stall,
            "stall_fraction": stall / trained if trained else 0.0,
            "bytes_per_rank": float(self.saves[-1]["bytes"]) if self.saves else 0.0,
            "final_wait_seconds": self._final_wait,
        }


def _per_save(saves: list[dict[str, Any]]) -> str:
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


def _host(trainer: L.Trainer) -> CheckpointHost:
    strategy = trainer.strategy
    if not is_checkpoint_host(strategy):
        raise TypeError(
            f"SpotCheckpoint writes pipeline-sharded checkpoints and needs strategy='spot_pipeline', "
            f"not {type(strategy).__name__}."
        )
    return strategy


def _timeline(trainer: L.Trainer) -> Optional[Timeline]:
    """The pipeline timeline being recorded, if any (``PipelineTimeline``)."""
    clock = _host(trainer).step_clock
    return clock.timeline if clock is not None else None


def _finished(records: list[dict[str, Any]], start: int) -> tuple[list[dict[str, Any]], int]:
    """The records from ``start`` whose background writing is over and was timed, and where to start next time.
    One write runs at a time and a new record waits for the previous write, so every record but the newest is
    over; one without a time (a dropped snapshot, a failed save) is skipped."""
    end = len(records) if records and "cpu_seconds" in records[-1] else max(start, len(records) - 1)
    return [r for r in records[start:end] if "cpu_seconds" in r], end


def checkpoints_last(trainer: L.Trainer) -> None:
    """Move ``SpotCheckpoint`` after every other callback, as Lightning orders its own checkpoint callbacks: a
    step's checkpoint then holds what the others changed at that step's end (``EMAWeightAveraging``'s average)."""
    callbacks = trainer.callbacks  # type: ignore[attr-defined]
    ours = [c for c in callbacks if isinstance(c, SpotCheckpoint)]
    if ours and callbacks[-len(ours) :] != ours:
        callbacks[:] = [c for c in callbacks if not isinstance(c, SpotCheckpoint)] + ours
