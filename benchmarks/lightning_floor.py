"""Lightning's own cost per step, without any strategy: the MLP of ``pipeline_throughput.py`` (8 x (Linear
512 + GELU), batch 64, Adam) in one process, trained by a plain ``Trainer(devices=1)`` and by a hand loop; and,
with ``--strategy``, by ``spot_pipeline`` on one device (P1xD1): the strategy's fixed cost per step.

    python benchmarks/lightning_floor.py [--steps 300] [--rounds 3]
    python benchmarks/lightning_floor.py --strategy [--microbatches 1]

Prints the median step time of each (median over rounds, alternating) and their differences: the part of the
strategy's overhead against a hand-written pipeline loop that any Lightning run has, and what the strategy adds
to a plain Lightning run where there is nothing to pipeline (on a GPU a short step pays it in full: the small
GPT of benchmarks/gpu_checks.sh took 11.3 against 9.7 ms on an H200).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

WIDTH, BATCH = 512, 64


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(8)])  # 8 blocks


def median_step_ms(starts: list[float], warmup: int = 20) -> float:
    return statistics.median(b - a for a, b in zip(starts[warmup:], starts[warmup + 1 :])) * 1e3


def hand(x: torch.Tensor, y: torch.Tensor, steps: int) -> float:
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    starts = []
    for s in range(steps):
        starts.append(time.perf_counter())
        rows = slice(s * BATCH, (s + 1) * BATCH)
        F.mse_loss(model(x[rows]), y[rows]).backward()
        optimizer.step()
        optimizer.zero_grad()
    starts.append(time.perf_counter())
    return median_step_ms(starts)


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return F.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), 1e-3)


class Starts(L.Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []
        self.threads = 0

    def on_train_start(self, *args: object) -> None:
        self.threads = torch.get_num_threads()

    def on_train_batch_start(self, *args: object) -> None:
        self.starts.append(time.perf_counter())


def lightning(x: torch.Tensor, y: torch.Tensor, steps: int, microbatches: int | None = None) -> float:
    """A plain Trainer, or with ``microbatches`` spot_pipeline on one device."""
    starts = Starts()
    strategy: object = "auto"
    if microbatches is not None:
        from lightning_spot import SpotPipelineStrategy

        strategy = SpotPipelineStrategy(pipeline_stages=1, microbatches=microbatches)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,  # type: ignore[arg-type]
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[starts],
    )
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    trainer.fit(Module(), loader)
    if starts.threads != 1:
        raise RuntimeError(f"the {strategy} run used {starts.threads} threads for tensor ops, the hand loop 1")
    return median_step_ms(starts.starts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--strategy", action="store_true", help="also spot_pipeline on one device (P1xD1)")
    p.add_argument("--microbatches", type=int, default=1, help="spot_pipeline's micro-batches per step")
    args = p.parse_args()
    # one thread for tensor ops in every run, as one of the pipeline benchmark's two processes on two cores: in the
    # environment too, or the launcher spot_pipeline uses (Lightning's, even for one process) sizes the pool by the
    # CPUs (2 here), for that run and, through the variable it sets, for every later one
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    x, y = torch.randn(BATCH * args.steps, WIDTH), torch.randn(BATCH * args.steps, WIDTH)
    results: dict[str, list[float]] = {"hand": [], "lightning": [], "spot_pipeline": []}
    for _ in range(args.rounds):
        results["hand"].append(hand(x, y, args.steps))
        results["lightning"].append(lightning(x, y, args.steps))
        if args.strategy:
            results["spot_pipeline"].append(lightning(x, y, args.steps, args.microbatches))
    h, lit = statistics.median(results["hand"]), statistics.median(results["lightning"])
    print(f"hand {h:.2f} ms/step, Lightning {lit:.2f} ms/step: Lightning's own {lit - h:.2f} ms/step ({lit / h:.3f}x)")
    if args.strategy:
        spot = statistics.median(results["spot_pipeline"])
        print(
            f"spot_pipeline P1xD1 M={args.microbatches} {spot:.2f} ms/step: {spot - lit:.2f} ms/step more than plain "
            f"Lightning ({spot / lit:.3f}x; rounds {', '.join(f'{a / b:.3f}' for a, b in zip(results['spot_pipeline'], results['lightning']))})"
        )


if __name__ == "__main__":
    main()
