"""``SpotCheckpoint``: sharded checkpoints in object storage that survive preemption and layout changes.

    ckpt = SpotCheckpoint(dirpath="s3://my-bucket/runs/gpt", every_n_train_steps=200, keep_last=3)
    trainer = L.Trainer(strategy=SpotPipelineStrategy(), callbacks=[ckpt], max_steps=100_000)
    trainer.fit(model, dm)      # the same command after a preemption resumes from the latest checkpoint

The callback decides *when*: its hooks open the tiers (``tiers``), choose where a resume reads from
(``resume``), contribute to the strategy's per-step agreement and carry out the decision of ``step_policy`` through the ``Saver``
(the I/O: copies to host memory, background uploads, retention), feed the measured costs to the ``Cadence`` and
keep the run's history (``run_record``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any, Optional, Union

import lightning as L
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_spot.checkpoint.cadence import Cadence
from lightning_spot.checkpoint.cost_feed import CostFeed
from lightning_spot.checkpoint.durable.from_snapshot import clear_spares
from lightning_spot.checkpoint.durable.storage import Storage
from lightning_spot.checkpoint.forwarded import Forwarded
from lightning_spot.checkpoint.loop_cost import LoopSteps
from lightning_spot.checkpoint.memory.snapshot import SnapshotStore
from lightning_spot.checkpoint.memory.snapshotter import Snapshotter
from lightning_spot.checkpoint.replica_rules import CheckpointRules, OwnCheckpoints
from lightning_spot.checkpoint.resume import ResumeOverride, newest_state
from lightning_spot.checkpoint.run_record import RunRecorder
from lightning_spot.checkpoint.saver import Saver, closing_line
from lightning_spot.checkpoint.step_policy import Agreed, StepPolicy
from lightning_spot.checkpoint.strategy_api import CheckpointHost, is_checkpoint_host
from lightning_spot.checkpoint.tiers import check_storage, open_snapshots
from lightning_spot.preemption.lightning_sigterm import take_over_sigterm
from lightning_spot.preemption.notice import Notice
from lightning_spot.preemption.stop import PreemptionStop, stop_for_preemption
from lightning_spot.preemption.watcher import PreemptionWatcher
from lightning_spot.utils.distributed import all_gather_object, broadcast_object, is_initialized

log = logging.getLogger(__name__)
#: SpotCheckpoint's name where it takes part: the choosers of the resume path (``resume.ResumeOverride``), the
#: per-step agreement (``step_agreement``)
PART = "spot_checkpoint"
#: what a coordinated stop needs beside its save (the report, the exit, the agent's leave), in seconds: a notice that
#: leaves less than this plus the last durable save's time gets the step's snapshot in host memory instead
STOP_MARGIN_S = 2.0


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

    #: settings held by the parts that act on them (changed after construction too, they reach those parts)
    every_n_train_steps = Forwarded("policy.every_n_train_steps", "cadence.durable_steps")
    every_n_minutes = Forwarded("cadence.durable_minutes")
    save_on_train_end = Forwarded("policy.save_on_train_end")
    keep_last = Forwarded("saver.keep_last")
    async_save = Forwarded("saver.async_save")
    io_threads = Forwarded("saver.io_threads")
    heartbeat_seconds = Forwarded("recorder.heartbeat_seconds")
    snapshot_every_n_train_steps = Forwarded("policy.snapshot_every_n_train_steps", "cadence.snapshot_steps")
    snapshot_every_n_seconds = Forwarded("cadence.snapshot_seconds")

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
        check_arguments(locals())
        self.dirpath = dirpath
        self.resume = resume
        self.storage_options = dict(storage_options or {})
        self.preemption = preemption
        self.cadence = Cadence(
            snapshot_steps=snapshot_every_n_train_steps,
            snapshot_seconds=snapshot_every_n_seconds,
            durable_steps=every_n_train_steps,
            durable_minutes=every_n_minutes,
            snapshots=snapshots,
        )
        self.costs = CostFeed(self.cadence)
        self.snapshot_dir = snapshot_dir
        self.snapshots: Optional[SnapshotStore] = None
        self.watcher: Optional[PreemptionWatcher] = None
        self.storage: Optional[Storage] = None
        self.recorder = RunRecorder(heartbeat_seconds)
        #: the saves and snapshots (their tiers opened at setup)
        self.saver = Saver(
            async_save=async_save, io_threads=io_threads, keep_last=keep_last, record=self.recorder.record
        )
        self.policy = StepPolicy(every_n_train_steps, snapshot_every_n_train_steps, snapshots, save_on_train_end)
        self._group: Optional[dist.ProcessGroup] = None
        #: who writes and which tiers are kept, the strategy's (``replica_rules``; torchft's in its jobs)
        self.rules: CheckpointRules = OwnCheckpoints()
        self._checked_step = -1
        #: the values agreed on the strategy's per-step agreement since the last step's end (see :meth:`_to_agree`)
        self._agreed: Optional[Agreed] = None
        self._train_start = 0.0
        self._train_seconds = 0.0
        self._undo_sigterm: Callable[[], None] = lambda: None
        self._final_wait = 0.0

    @property
    def state_key(self) -> str:
        return "SpotCheckpoint"

    @property
    def url(self) -> str:
        if self.storage is None:
            raise RuntimeError("SpotCheckpoint is set up when fit starts")
        return self.storage.url

    @property
    def saves(self) -> list[dict[str, Any]]:
        """Each save of this run: step, stall, bytes, reason, write time."""
        return self.saver.saves

    @property
    def snapshotter(self) -> Optional[Snapshotter]:
        return self.saver.snapshotter

    @property
    def report(self) -> dict[str, Any]:
        """The end-of-run report (rank 0): restarts survived, steps recomputed, time lost, checkpoint stall."""
        return self.recorder.report

    # ------------------------------------------------------------------- setup
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != TrainerFn.FITTING.value:
            return
        host = _host(trainer)
        url = broadcast_object(self.dirpath or os.path.join(trainer.default_root_dir, "spot_checkpoints"))
        self.rules = host.checkpoint_rules
        if not self.rules.keeps_snapshots and self.cadence.snapshots:
            rank_zero_info("SpotCheckpoint: no snapshots in host memory: the other pipelines hold this one's state")
            self.cadence.snapshots = False
        if self.cadence.snapshots:
            asked = bool(self.snapshot_every_n_train_steps or self.snapshot_every_n_seconds)  # (else by default)
            # (torchft: each pipeline keeps its own, apart from the other pipelines' on the node)
            self.snapshots = open_snapshots(url, self.snapshot_dir, explicit=asked, part=self.rules.history_id)
            self.cadence.snapshots = self.snapshots is not None
        self.policy.snapshots = self.snapshots is not None
        host.use_checkpoint_storage(self.storage_options, url, self.snapshots)
        self.storage = Storage(url, self.storage_options)
        check_storage(self.storage, snapshots=self.snapshots is not None)
        if self.async_save and is_initialized() and self._group is None:
            self._group = dist.new_group(backend="gloo")
        self.saver.open(self.storage, self.snapshots, self._group)
        ResumeOverride.of(trainer).add(PART, lambda path: self._resume_path(trainer, path))
        if self.preemption and self.watcher is None:
            self.watcher = self.preemption if isinstance(self.preemption, PreemptionWatcher) else PreemptionWatcher()
        history = self.rules.history_id  # torchft: each pipeline's own (its restarts, the quorums it saw)
        self.recorder.open(self.storage, url, self.storage_options, history, enabled=trainer.is_global_zero)

    def _resume_path(self, trainer: L.Trainer, checkpoint_path: Optional[str]) -> Optional[str]:
        """Where ``fit`` without ``ckpt_path`` resumes from (``resume.newest_state``); ``None``: as asked."""
        if checkpoint_path or not self.resume or trainer.state.fn != TrainerFn.FITTING:
            return None
        assert self.storage is not None
        return newest_state(trainer, self.storage, _host(trainer) if self.snapshots is not None else None)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        try:
            self.wait()
        finally:
            if self.watcher is not None:
                self.watcher.stop()
                self._undo_sigterm()
            if is_checkpoint_host(trainer.strategy):
                trainer.strategy.step_agreement.leave(PART)
            self.recorder.close()
            ResumeOverride.of(trainer).remove(PART)

    def state_dict(self) -> dict[str, Any]:
        return {}

    # ------------------------------------------------------------------- hooks
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        saver = self.saver
        self._train_start = saver.last_snapshot_time = saver.last_time = time.monotonic()
        # a forward may change buffers: snapshots copy them at once, the rest before the next optimizer step
        saver.buffer_names = frozenset(name for name, _ in pl_module.named_buffers())
        saver.last_step = self._checked_step = trainer.global_step
        saver.loop = LoopSteps()
        self._agreed = None
        _host(trainer).step_agreement.join(PART, self._to_agree, self._on_agreed)
        if self.watcher is not None:
            self.watcher.start()
            self._undo_sigterm = take_over_sigterm(trainer, self.watcher)  # its notices are agreed per step below
        if self.snapshots is not None and trainer.local_rank == 0:
            self.snapshots.drop_after(trainer.global_step)  # newer ones belong to the attempt that failed
        if self.cadence.auto_durable:
            history = self.recorder.history(self.url, saver.opened()) if trainer.is_global_zero else None
            self.cadence.set_history(*broadcast_object(history))
        self.recorder.started(trainer, _host(trainer))

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.saver.copies_done()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.saver.copies_done()  # (an average swapped in for validation, in the hooks that follow this one)

    def _to_agree(self) -> Optional[list[float]]:
        """This rank's values (``Agreed.posted``), posted at a step's start on the strategy's per-step agreement:
        every rank decides alike on the largest values (clocks and measured costs differ between ranks); ``None``:
        nothing to agree on."""
        snap_every, durable_every = self.cadence.snapshot_every(), self.cadence.durable_every()
        if snap_every is None and durable_every is None and self.watcher is None:
            return None
        saver, now = self.saver, time.monotonic()
        notice = self.watcher is not None and self.watcher.notice is not None
        agreed = Agreed(notice, now - saver.last_snapshot_time, snap_every or 0.0, now - saver.last_time,
                        durable_every or 0.0, saver.writing_snapshot)  # fmt: skip
        return agreed.posted()

    def _on_agreed(self, values: list[float]) -> None:
        self._agreed = Agreed.of(values)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step == self._checked_step:  # only at optimizer-step boundaries (not inside an accumulation window)
            return
        self._checked_step = step
        _host(trainer).step_agreement.settle()  # (usually settled already, after the optimizer step)
        loop = self.saver.loop
        loop.step_ended(time.monotonic())
        try:
            self._at_step_end(trainer, step)
        finally:
            loop.back_to_training(time.monotonic())

    def _at_step_end(self, trainer: L.Trainer, step: int) -> None:
        self.recorder.progress(trainer, _host(trainer), self.rules.events())
        said = self.costs.observe(self.saver)
        if said is not None:
            rank_zero_info(said)
            self.recorder.record("cadence", step=trainer.global_step, **self.cadence.chosen())
        agreed, self._agreed = self._agreed, None
        ending = (trainer.max_steps not in (None, -1) and step >= trainer.max_steps) or trainer.should_stop
        decision = self.policy.decide(step, agreed, ending=ending)
        if decision.stop_for_notice:
            stop_for_preemption(
                self.watcher.notice if self.watcher is not None else None,
                step=trainer.global_step,
                save=lambda reason, notice: self._stop_save(trainer, reason, notice),
                report=lambda stop: self._preempted(trainer, stop),
            )
        if decision.save is not None:
            self.save(trainer, reason=decision.save)
        elif decision.snapshot:
            self.snapshot(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.saver.copies_done()  # (before on_train_end's hooks: an average copied into the model)
        last_epoch = trainer.max_epochs not in (None, -1) and trainer.current_epoch + 1 >= trainer.max_epochs
        if self.save_on_train_end and last_epoch and trainer.global_step != self.saver.last_step:
            self.save(trainer, reason="end")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        saver = self.saver
        if self.save_on_train_end and trainer.global_step != saver.last_step:
            # stopped by something else (max_time, a callback): the loops are already wound up, so a resume
            # from this checkpoint starts the next epoch
            self.save(trainer, reason="end", blocking=True)
        self._train_seconds = time.monotonic() - self._train_start
        waited = time.monotonic()
        self.wait()  # the last upload: training is over, but the run is not done until it is committed
        self._final_wait = time.monotonic() - waited
        if trainer.is_global_zero and self.storage is not None:
            clear_spares(self.storage)  # every upload is committed
        summary = self.summary()
        self.recorder.ended(trainer, self.url, summary["stall_fraction"])
        saver.clear_snapshots(trainer)
        if self.saves and trainer.is_global_zero:
            rank_zero_info(closing_line(summary, self.saves, self.url, self._train_seconds))

    # ---------------------------------------------------------- save, snapshot
    def save(self, trainer: L.Trainer, *, reason: str = "on demand", blocking: bool = False) -> None:
        """Checkpoint the current step on every rank (collective); ``blocking`` waits until it is committed."""
        if not self.rules.writes():  # torchft: another pipeline of the quorum writes this step
            self.saver.skipped(trainer.global_step)
            if self.snapshots is not None and not blocking:  # (this one keeps the step in its own memory)
                self.snapshot(trainer)
            return
        self.saver.save(trainer, _host(trainer), reason=reason, blocking=blocking)

    def _stop_save(self, trainer: L.Trainer, reason: str, notice: Notice) -> str:
        """The coordinated stop's save (collective): a durable checkpoint; or, when the notice leaves less time than
        the last durable save took, this step's snapshot in host memory, copied to the next node where a stage
        lives on one node (said in the log). Returns what was committed."""
        left, took = notice.seconds_left(), self.saver.durable_seconds()
        short = self.snapshots is not None and left is not None and took is not None and took + STOP_MARGIN_S > left
        # (over the default group, which only this thread uses: the saver's carries the collectives of a background
        # upload that may still be in flight, and two threads' collectives on one group pair up wrongly and hang)
        if broadcast_object(short):  # (the first rank timed the saves)
            kept = self.saver.snapshot_now(trainer, _host(trainer))
            if all(all_gather_object(kept)):
                snapshotter = self.saver.snapshotter
                where = (
                    "copied to the next node"
                    if snapshotter and snapshotter.peer_copy
                    else "not copied: every stage has a replica on another node, or the job is on one machine"
                )
                if trainer.is_global_zero:  # (the rank that timed the durable saves)
                    log.warning(
                        "lightning-spot: the notice leaves %.1fs, less than a durable checkpoint needs (the last took "
                        "%.2fs, the stop %.0fs more): step %d is kept in host memory instead (%s); a restart resumes "
                        "from it (the last durable save was of step %s).",
                        left,
                        took,
                        STOP_MARGIN_S,
                        trainer.global_step,
                        where,
                        self.saver.last_step,
                    )
                return "snapshot in host memory"
            if trainer.is_global_zero:
                log.warning(
                    "lightning-spot: the stop's snapshot could not be kept on every rank: a durable save instead."
                )
        self.save(trainer, reason=reason, blocking=True)
        return "checkpoint"

    def snapshot(self, trainer: L.Trainer) -> None:
        """Keep this rank's state of this step in host memory (written in the background; not collective)."""
        self.saver.snapshot(trainer, _host(trainer))

    def wait(self) -> None:
        """Block until the background save (if any) is committed; re-raise its error."""
        self.saver.wait()

    def _preempted(self, trainer: L.Trainer, stop: PreemptionStop) -> None:
        """Record a coordinated stop (its checkpoint is committed; the process exits next)."""
        clock = _host(trainer).step_clock
        self.recorder.preempted(stop, clock.timeline if clock is not None else None)

    def summary(self) -> dict[str, float]:
        """Checkpoint figures for this rank: saves; the stall (time the training loop was blocked by saves)
        and its fraction of training time; the wait for the last upload after training ended; the snapshots taken
        between saves and their stall."""
        trained = self._train_seconds or max(time.monotonic() - self._train_start, 1e-9)
        return self.saver.summary(trained, self._final_wait)


def _host(trainer: L.Trainer) -> CheckpointHost:
    strategy = trainer.strategy
    if not is_checkpoint_host(strategy):
        raise TypeError(
            f"SpotCheckpoint writes pipeline-sharded checkpoints and needs strategy='spot_pipeline', "
            f"not {type(strategy).__name__}."
        )
    return strategy


def check_arguments(args: dict[str, Any]) -> None:
    """``SpotCheckpoint``'s arguments that cannot work, named with the fix (``args``: its ``__init__``'s)."""
    for name in ("keep_last", "every_n_train_steps", "snapshot_every_n_train_steps"):
        if args[name] is not None and args[name] < 1:
            raise ValueError(f"{name} must be >= 1, got {args[name]}")
    for name in ("every_n_minutes", "snapshot_every_n_seconds"):
        if args[name] is not None and args[name] <= 0:
            raise ValueError(f"{name} must be > 0, got {args[name]}")
    asked = next((n for n in ("snapshot_every_n_train_steps", "snapshot_every_n_seconds") if args[n]), None)
    if not args["snapshots"] and asked:
        raise ValueError(
            f"SpotCheckpoint(snapshots=False, {asked}=...) asks for no snapshots and for snapshots at an interval: "
            f"drop {asked} to train without snapshots, or snapshots=False to take them at that interval."
        )


def checkpoints_last(trainer: L.Trainer) -> None:
    """Move ``SpotCheckpoint`` after every other callback, as Lightning orders its own checkpoint callbacks: a
    step's checkpoint then holds what the others changed at that step's end (``EMAWeightAveraging``'s average)."""
    callbacks = trainer.callbacks  # type: ignore[attr-defined]
    ours = [c for c in callbacks if isinstance(c, SpotCheckpoint)]
    if ours and callbacks[-len(ours) :] != ours:
        callbacks[:] = [c for c in callbacks if not isinstance(c, SpotCheckpoint)] + ours
