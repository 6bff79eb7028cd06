"""What replaying the user's step costs a stage, per micro-batch, in one process: the MLP of
``pipeline_throughput.py`` (8 x (Linear + GELU), micro-batches of 16 rows) cut into 4 stages, each stage's
``StepRunner`` path against calling that stage's layers directly (plus the loss on the last stage).

    python benchmarks/replay_overhead.py [--width 512] [--rounds 7]

The first stage replays the step up to its layers, the last from the received activation to the loss; a stage
between them replays once and then, where ``nn.Sequential`` chains the layers, calls only them. ``--width 32``
leaves little but the Python around the layers.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from lightning_spot import discover, plan_stages
from lightning_spot.partition.placement import place_stages
from lightning_spot.runtime.logging_bridge import LogCapture
from lightning_spot.runtime.metric_bridge import MetricCalls
from lightning_spot.runtime.step_runner import StepRunner

STAGES, ROWS, MICROBATCHES = 4, 16, 4


class MLP(L.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)


def per_call_us(fn: Callable[[int], object], rounds: int, calls: int = 400) -> float:
    for i in range(50):
        fn(i)
    times = []
    for _ in range(rounds):
        start = time.thread_time()
        for i in range(calls):
            fn(i)
        times.append((time.thread_time() - start) / calls * 1e6)
    return statistics.median(times)


def stage(rank: int, width: int, rounds: int) -> tuple[float, float]:
    """(replayed, direct) microseconds per micro-batch on pipeline rank ``rank``."""
    torch.manual_seed(0)
    module = MLP(width)
    split = discover(module)
    place_stages(module, split, plan_stages(split.num_layers, STAGES), pp_rank=rank, device=torch.device("cpu"))
    runner = StepRunner(module, num_stages=STAGES, capture=LogCapture(), device=torch.device("cpu"))
    runner.metric_calls = MetricCalls(module, None, rank == STAGES - 1)
    runner._warned_unweighted = True  # (no watch for ignored targets: it ends after the first steps)
    x, y = torch.randn(ROWS * MICROBATCHES, width), torch.randn(ROWS * MICROBATCHES, width)
    chunks = torch.arange(ROWS * MICROBATCHES).tensor_split(MICROBATCHES)
    layers = [m for m in module.layers if type(m) is nn.Sequential]  # this rank's (the others are stand-ins)
    received = torch.randn(ROWS, width, requires_grad=True)

    def replayed(i: int) -> object:
        runner.chunk = chunk = i % MICROBATCHES
        if rank == STAGES - 1:
            runner._losses_computed = 0
            if chunk == 0:  # a new step: the losses kept are the step's (thousands kept slow each call by ~25 us)
                runner.loss_weights.start()
            return runner.loss_fn(runner.stage_forward(rank, (received,)), chunks[chunk])
        return runner.stage_forward(rank, (chunks[chunk],) if rank == 0 else (received,))

    def direct(i: int) -> object:
        rows = chunks[i % MICROBATCHES]
        out = x.index_select(0, rows) if rank == 0 else received
        for layer in layers:
            out = layer(out)
        return F.mse_loss(out, y.index_select(0, rows)) / MICROBATCHES if rank == STAGES - 1 else out

    with runner.bind("training_step", "train", (x, y), (0,), {}, MICROBATCHES):
        return per_call_us(replayed, rounds), per_call_us(direct, rounds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    for rank in range(STAGES):
        replayed, direct = stage(rank, args.width, args.rounds)
        print(
            f"stage {rank}: replayed {replayed:7.1f} us, layers called directly {direct:7.1f} us, "
            f"overhead {replayed - direct:6.1f} us per micro-batch"
        )


if __name__ == "__main__":
    main()
