"""The run's history as ``SpotCheckpoint`` keeps it: its start, progress, faults, checkpoints, a preemption, its end.

    record = RunRecorder(heartbeat_seconds=30.0)
    record.open(storage, url, storage_options, replica_group=None, enabled=trainer.is_global_zero)
    record.started(trainer, host)          # the "start" event: resumed from where, on which layout
    record.progress(trainer, host, events) # each step: faults, the first step, a heartbeat now and then
    record.ended(trainer, url, stall)      # the "end" event and the report (restarts survived, time lost)

Rank 0 writes (the journal is a no-op elsewhere). Under torchft each pipeline keeps its own history in
``<run>/pipeline-<id>/`` (its restarts, the quorums it saw); the run's checkpoints stay in the run directory.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Optional

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_spot.checkpoint.durable.journal import (
    PIPELINE_HISTORY,
    Journal,
    interruption_history,
    read_events,
    summarize,
)
from lightning_spot.checkpoint.durable.storage import Storage
from lightning_spot.checkpoint.strategy_api import CheckpointHost
from lightning_spot.preemption.stop import PreemptionStop
from lightning_spot.runtime.clock import Timeline
from lightning_spot.runtime.process import process_started

log = logging.getLogger(__name__)


class RunRecorder:
    """The journal of one run (see the module's text) and the report made from it at the end."""

    def __init__(self, heartbeat_seconds: float) -> None:
        #: how often progress is recorded (for the report of time lost after a crash)
        self.heartbeat_seconds = heartbeat_seconds
        self.journal: Optional[Journal] = None
        #: the end-of-run report (rank 0): restarts survived, steps recomputed, time lost, checkpoint stall
        self.report: dict[str, Any] = {}
        self._first_step_seen = False
        self._last_heartbeat = 0.0

    def open(
        self, storage: Storage, url: str, storage_options: dict[str, Any], replica_group: Optional[str], enabled: bool
    ) -> None:
        """Start (or keep) the journal: in the run directory, or the pipeline's own one under torchft."""
        if self.journal is not None:
            return
        history = (
            storage
            if replica_group is None
            else Storage(f"{url.rstrip('/')}/{PIPELINE_HISTORY}{replica_group}", storage_options)
        )
        self.journal = Journal(history, enabled=enabled)

    def record(self, kind: str, **fields: Any) -> None:
        if self.journal is not None:
            self.journal.record(kind, **fields)

    def history(self, url: str, storage: Storage) -> tuple[float, int]:
        """This run's running time and interruptions so far (rank 0; unreadable history: none)."""
        try:
            return interruption_history(self.journal.storage if self.journal is not None else storage)
        except Exception as err:
            log.warning("lightning-spot: cannot read the run history of %s (%s); assuming no interruption", url, err)
            return 0.0, 0

    def started(self, trainer: L.Trainer, host: CheckpointHost) -> None:
        restored = host.restored_manifest
        self.record(
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

    def progress(self, trainer: L.Trainer, host: CheckpointHost, events: list[dict[str, Any]]) -> None:
        """At a step's end: the fault events (``CheckpointRules.events``), the first step, and a heartbeat every so
        often."""
        for event in events:
            self.record(**event)
        batch = host.last_global_batch
        if not self._first_step_seen:
            self._first_step_seen = True
            self.record("first_step", step=trainer.global_step, global_batch=batch)
        elif time.monotonic() - self._last_heartbeat >= self.heartbeat_seconds:
            self.record("progress", step=trainer.global_step, global_batch=batch)
        else:
            return
        self._last_heartbeat = time.monotonic()

    def preempted(self, stop: PreemptionStop, timeline: Optional[Timeline]) -> None:
        """A coordinated stop (its checkpoint is committed; the process exits next)."""
        if timeline is not None:
            now = time.perf_counter()
            timeline.add("preemption stop", "preemption", now - stop.save_seconds, now, source=stop.notice.source)
        rank_zero_info(f"SpotCheckpoint: {stop.describe()}")
        if self.journal is not None:
            self.journal.record("preempted", **stop.event())
            self.journal.close()

    def ended(self, trainer: L.Trainer, url: str, stall_fraction: float) -> None:
        """The "end" event; on rank 0 the report: printed and logged to the trainer's loggers."""
        self.record("end", step=trainer.global_step)
        if not trainer.is_global_zero or self.journal is None:
            return
        self.journal.flush()
        self.report = summarize(read_events(self.journal.storage))
        self.report["checkpoint_stall_fraction"] = stall_fraction
        metrics = {
            "spot/preemptions_survived": float(self.report["preemptions_survived"]),
            "spot/steps_recomputed": float(self.report["steps_recomputed"]),
            "spot/time_lost_seconds": float(self.report["time_lost_seconds"]),
            "spot/checkpoint_stall_fraction": float(stall_fraction),
        }
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        lines = [
            f"SpotCheckpoint report for {url}: {self.report['preemptions_survived']} restart(s) survived, "
            f"{self.report['steps_recomputed']} step(s) recomputed, {self.report['time_lost_seconds']:.1f}s lost to restarts"
        ]
        for r in self.report["restarts"]:
            lines.append(
                f"  {r['cause']}: stopped at step {r['stopped_at_step']}, resumed from step {r['resumed_from_step']}, "
                f"{r['time_lost_seconds']:.1f}s lost"
            )
        rank_zero_info("\n".join(lines))

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()
            self.journal = None
