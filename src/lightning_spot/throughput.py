"""A callback that reports training throughput: global samples/s (and tokens/s) per step.

    trainer = L.Trainer(strategy="spot_pipeline", callbacks=[PipelineThroughput(tokens_per_sample=1024)])
    ...
    trainer.callbacks[0].summary()   # {"samples_per_sec": ..., "tokens_per_sec": ..., "step_seconds": ...}

Works with any strategy; under spot_pipeline the global batch is the local batch x data-parallel width.
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_spot.pipeline import batch_size_of


class PipelineThroughput(L.Callback):
    """Times every training step after ``warmup_steps`` and logs ``throughput/samples_per_sec``."""

    def __init__(self, tokens_per_sample: int | None = None, warmup_steps: int = 3, prog_bar: bool = True) -> None:
        self.tokens_per_sample = tokens_per_sample
        self.warmup_steps = warmup_steps
        self.prog_bar = prog_bar
        self._start = 0.0
        self._seen = 0
        self._times: list[float] = []
        self._samples: list[int] = []

    def _global_batch(self, trainer: L.Trainer, batch: Any) -> int:
        layout = getattr(trainer.strategy, "layout", None)
        replicas = layout.data_parallel if layout is not None else trainer.world_size
        return batch_size_of(batch) * replicas

    @staticmethod
    def _sync(trainer: L.Trainer) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._sync(trainer)
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._sync(trainer)
        elapsed = time.perf_counter() - self._start
        self._seen += 1
        if self._seen <= self.warmup_steps:
            return
        samples = self._global_batch(trainer, batch)
        self._times.append(elapsed)
        self._samples.append(samples)
        pl_module.log("throughput/samples_per_sec", samples / elapsed, prog_bar=self.prog_bar, on_step=True)
        if self.tokens_per_sample:
            pl_module.log("throughput/tokens_per_sec", samples * self.tokens_per_sample / elapsed, on_step=True)

    @property
    def step_times(self) -> list[float]:
        """Wall-clock seconds of every timed step (after the warm-up), on this rank."""
        return list(self._times)

    def summary(self) -> dict[str, float]:
        """Mean figures over the timed steps (empty before the warm-up is over)."""
        if not self._times:
            return {}
        total = sum(self._times)
        out = {
            "steps": float(len(self._times)),
            "step_seconds": total / len(self._times),
            "samples_per_sec": sum(self._samples) / total,
        }
        if self.tokens_per_sample:
            out["tokens_per_sec"] = out["samples_per_sec"] * self.tokens_per_sample
        return out

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        s = self.summary()
        if s:
            layout = getattr(trainer.strategy, "layout", None)
            tokens = f", {s['tokens_per_sec']:.0f} tokens/s" if "tokens_per_sec" in s else ""
            rank_zero_info(
                f"throughput{f' ({layout})' if layout else ''}: {s['samples_per_sec']:.1f} samples/s{tokens}, "
                f"{s['step_seconds'] * 1000:.1f} ms/step over {int(s['steps'])} steps"
            )
