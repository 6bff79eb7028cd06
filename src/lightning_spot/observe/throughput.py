"""A callback that reports training throughput: global samples/s (and tokens/s) per step, the
pipeline bubble (measured and the schedule's theoretical one) and, on GPUs, model FLOPs utilisation.

    trainer = L.Trainer(strategy="spot_pipeline", callbacks=[PipelineThroughput(tokens_per_sample=1024)])
    ...
    trainer.callbacks[0].summary()   # {"samples_per_sec": ..., "tokens_per_sec": ..., "step_seconds": ..., "bubble": ...}

Logged every step: ``throughput/samples_per_sec`` (progress bar), ``throughput/tokens_per_sec``,
``pipeline/bubble`` (progress bar; this rank's idle share of the schedule: rank 0 holds the first
stage), ``pipeline/bubble_theory`` and ``throughput/mfu`` (CUDA, when the FLOPs per sample are known:
given, or 6 x parameters x tokens for a decoder). The progress bar also shows the layout.

Works with any strategy; under spot_pipeline the global batch is the local batch x data-parallel width.
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_spot.observe.strategy_api import pipeline_host
from lightning_spot.planning.hardware import sync_device
from lightning_spot.runtime.step_runner import batch_size_of


class PipelineThroughput(L.Callback):
    """Times every training step after ``warmup_steps`` and logs ``throughput/samples_per_sec``."""

    def __init__(
        self,
        tokens_per_sample: int | None = None,
        warmup_steps: int = 3,
        prog_bar: bool = True,
        flops_per_sample: float | None = None,
        peak_flops: float | None = None,
    ) -> None:
        """``flops_per_sample``: training FLOPs (forward + backward) per sample; default 6 x parameters x
        ``tokens_per_sample`` when that is given. ``peak_flops``: one device's peak (default: looked up
        for known GPUs, bf16 dense)."""
        self.tokens_per_sample = tokens_per_sample
        self.warmup_steps = warmup_steps
        self.prog_bar = prog_bar
        self.flops_per_sample = flops_per_sample
        self.peak_flops = peak_flops
        self._start = 0.0
        self._seen = 0
        self._times: list[float] = []
        self._samples: list[int] = []
        self._bubbles: list[float] = []
        self._mfu: list[float] = []
        self._layout_text = ""
        self._restore_bar: Any = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.flops_per_sample is None and self.tokens_per_sample:
            self.flops_per_sample = 6.0 * model_parameters(trainer) * self.tokens_per_sample
        if self.peak_flops is None and trainer.strategy.root_device.type == "cuda":
            self.peak_flops = peak_flops_of(torch.cuda.get_device_name(trainer.strategy.root_device))
        bar = trainer.progress_bar_callback
        if bar is not None and self.prog_bar and self._restore_bar is None:
            original = bar.get_metrics

            def get_metrics(*args: Any, **kwargs: Any) -> dict[str, Any]:
                metrics = original(*args, **kwargs)
                if self._layout_text:
                    metrics["layout"] = self._layout_text
                return metrics

            bar.get_metrics = get_metrics  # type: ignore[method-assign]
            self._restore_bar = (bar, original)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._restore_bar is not None:
            bar, original = self._restore_bar
            bar.get_metrics = original
            self._restore_bar = None

    def _global_batch(self, trainer: L.Trainer, batch: Any) -> int:
        host = pipeline_host(trainer.strategy)
        if host is not None and host.last_global_batch:
            return host.last_global_batch  # pipelines of mixed depths load shares of different sizes
        return batch_size_of(batch) * trainer.world_size

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        sync_device(trainer.strategy.root_device)
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        sync_device(trainer.strategy.root_device)
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
        host = pipeline_host(trainer.strategy)
        stats = host.pipeline_stats() if host is not None else {}
        if stats:
            self._bubbles.append(stats["bubble"])
            pl_module.log("pipeline/bubble", stats["bubble"], prog_bar=self.prog_bar, on_step=True)
            pl_module.log("pipeline/bubble_theory", stats["bubble_theory"], on_step=True)
            self._layout_text = stats["pipeline_layout"]
        if self.flops_per_sample and self.peak_flops and trainer.strategy.root_device.type == "cuda":
            mfu = samples * self.flops_per_sample / elapsed / (self.peak_flops * trainer.world_size)
            self._mfu.append(mfu)
            pl_module.log("throughput/mfu", mfu, prog_bar=self.prog_bar, on_step=True)

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
        if self._bubbles:
            out["bubble"] = sum(self._bubbles) / len(self._bubbles)
        if self._mfu:
            out["mfu"] = sum(self._mfu) / len(self._mfu)
        return out

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        s = self.summary()
        if s:
            tokens = f", {s['tokens_per_sec']:.0f} tokens/s" if "tokens_per_sec" in s else ""
            bubble = f", bubble {100 * s['bubble']:.1f}% on rank 0" if "bubble" in s else ""
            mfu = f", MFU {100 * s['mfu']:.1f}%" if "mfu" in s else ""
            rank_zero_info(
                f"throughput{f' ({self._layout_text})' if self._layout_text else ''}: {s['samples_per_sec']:.1f} samples/s"
                f"{tokens}, {s['step_seconds'] * 1000:.1f} ms/step over {int(s['steps'])} steps{bubble}{mfu}"
            )


#: dense bf16 peak FLOP/s of one device, by a part of its CUDA name (first match wins)
PEAK_BF16_FLOPS = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("V100", 125e12),
    ("T4", 65e12),
)


def peak_flops_of(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU by name, or ``None`` if unknown (pass ``peak_flops=``)."""
    return next((flops for part, flops in PEAK_BF16_FLOPS if part in device_name), None)


def model_parameters(trainer: L.Trainer) -> int:
    """Parameters of the whole model, also when each rank holds only its pipeline stage (collective)."""
    host = pipeline_host(trainer.strategy)
    if host is not None:
        return host.count_parameters()
    return sum(p.numel() for p in trainer.lightning_module.parameters())
