"""``PipelineTimeline``: record a few training steps on every rank and save them as a Chrome / Perfetto
trace and a Gantt chart.

    trainer = L.Trainer(strategy="spot_pipeline", callbacks=[PipelineTimeline(start_step=5, num_steps=3)])
    # -> <default_root_dir>/pipeline_timeline/trace.json (open in ui.perfetto.dev) and timeline.png

Outside the recorded steps nothing is traced (the engine only reads two clocks per micro-batch for
the bubble figure). If training stops with an exception (a preemption, say), every rank writes what
it recorded to ``rank<N>.trace.json`` instead, without talking to the others.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Optional

import fsspec
import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_spot.observe.strategy_api import pipeline_host
from lightning_spot.runtime.clock import StepClock, Timeline
from lightning_spot.utils.distributed import all_gather_object


class PipelineTimeline(L.Callback):
    """Trace ``num_steps`` training steps from ``start_step`` on (global steps) on every rank.

    Args:
        dirpath: where ``trace.json`` and ``timeline.png`` go (any fsspec URL); default
            ``<default_root_dir>/pipeline_timeline``.
        start_step: first global step to record (skip the first steps: they build schedules).
        num_steps: how many steps to record.
        gantt: also draw ``timeline.png`` (needs matplotlib).
        storage_options: passed to fsspec.
    """

    def __init__(
        self,
        dirpath: Optional[str] = None,
        start_step: int = 2,
        num_steps: int = 3,
        gantt: bool = True,
        storage_options: Optional[dict[str, Any]] = None,
    ) -> None:
        if start_step < 0 or num_steps < 1:
            raise ValueError(
                f"PipelineTimeline needs start_step >= 0 and num_steps >= 1, got {start_step} and {num_steps}"
            )
        self.dirpath = dirpath
        self.start_step = start_step
        self.num_steps = num_steps
        self.gantt = gantt
        self.storage_options = storage_options or {}
        self.timeline: Optional[Timeline] = None
        self.trace: Optional[dict[str, Any]] = None
        self.files: list[str] = []
        self._step_start = 0.0

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        host = pipeline_host(trainer.strategy)
        if stage == "fit" and host is not None:
            host.trace_allreduce = True
        self.timeline = Timeline(rank=trainer.global_rank)
        self.trace = None

    def _recording(self, step: int) -> bool:
        return self.start_step <= step < self.start_step + self.num_steps

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        clock = _clock(trainer)
        if clock is not None:
            clock.timeline = self.timeline if self._recording(trainer.global_step) else None
        self._step_start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step - 1  # the step that just ran
        if self.timeline is not None and self._recording(step):
            self.timeline.add(f"step {step}", "step", self._step_start, time.perf_counter(), lane="steps", step=step)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._detach(trainer)
        assert self.timeline is not None
        gathered = all_gather_object(self.timeline.chrome_events())
        if not trainer.is_global_zero:
            return
        self.trace = merge_traces(gathered, _metadata(trainer))
        if not any(e.get("ph") == "X" for e in self.trace["traceEvents"]):
            rank_zero_info(
                f"PipelineTimeline: no step in [{self.start_step}, {self.start_step + self.num_steps}) ran; nothing to save"
            )
            return
        self._save(trainer, "trace.json", json.dumps(self.trace).encode())
        if self.gantt:
            from lightning_spot.observe.gantt import render_gantt

            self._save(trainer, "timeline.png", render_gantt(self.trace))
        rank_zero_info(
            f"PipelineTimeline: steps {self.start_step}..{self.start_step + self.num_steps - 1} traced: "
            + ", ".join(self.files)
        )

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._detach(trainer)
        if self.timeline is not None and self.timeline.events:
            self._save(
                trainer,
                f"rank{trainer.global_rank}.trace.json",
                json.dumps(merge_traces([self.timeline.chrome_events()], _metadata(trainer))).encode(),
            )

    # ---------------------------------------------------------------- helpers
    @staticmethod
    def _detach(trainer: L.Trainer) -> None:
        clock = _clock(trainer)
        if clock is not None:
            clock.timeline = None

    def _save(self, trainer: L.Trainer, name: str, data: bytes) -> None:
        root = self.dirpath or os.path.join(trainer.default_root_dir, "pipeline_timeline")
        fs, path = fsspec.core.url_to_fs(root, **self.storage_options)
        fs.makedirs(path, exist_ok=True)
        target = f"{path.rstrip('/')}/{name}"
        with fs.open(target, "wb") as f:
            f.write(data)
        self.files.append(root.rstrip("/") + "/" + name)


def _clock(trainer: L.Trainer) -> Optional[StepClock]:
    host = pipeline_host(trainer.strategy)
    return host.step_clock if host is not None else None


def _metadata(trainer: L.Trainer) -> dict[str, Any]:
    """The layout the trace was recorded on (rendered as the chart's title)."""
    host = pipeline_host(trainer.strategy)
    layout = host.pipeline_layout.to_dict() if host is not None and host.step_clock is not None else {}
    return {"layout": layout, "world_size": trainer.world_size}


def merge_traces(per_rank: list[list[dict[str, Any]]], metadata: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """One Chrome-trace JSON object from every rank's events (open it in ui.perfetto.dev or chrome://tracing)."""
    events = [e for rank in per_rank for e in rank]
    return {"traceEvents": events, "displayTimeUnit": "ms", "metadata": metadata or {}}
