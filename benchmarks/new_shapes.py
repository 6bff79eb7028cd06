"""What a new batch shape costs a pipeline step: batches padded to their own length (dynamic padding, as
``DataCollatorWithPadding`` does) against one length.

Each new shape of a batch builds the pipeline's schedule again, with one shape-inference forward (up to 8 schedules
are kept). With lengths drawn from 8..63 almost every step meets a new shape. The model: ``tests.models``'
``TinyPipelineModel`` on sequences (8 residual blocks of ``--width``), P2xD1, 4 micro-batches, batches of 16; rank 0's
step time from one step's start to the next (median after 10 steps).

    python benchmarks/new_shapes.py                  # width 256: a step of ~19 ms
    python benchmarks/new_shapes.py --width 1024     # a step of ~190 ms: the cost stays a few ms
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _worker(vary: bool, width: int, steps: int) -> None:
    sys.path.insert(0, str(REPO))
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, Dataset

    from lightning_spot import SpotPipelineStrategy
    from tests.models import IN, OUT, TinyPipelineModel

    class Sequences(Dataset):
        def __init__(self, n: int) -> None:
            g = torch.Generator().manual_seed(0)
            self.x = torch.randn(n, 64, IN, generator=g)
            self.lengths = torch.randint(8, 64, (n // 16,), generator=g)

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> int:
            return i

        def collate(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
            length = int(self.lengths[rows[0] // 16]) if vary else 40
            x = self.x[rows, :length]
            return x, torch.tanh(x[..., :OUT])

    class Model(TinyPipelineModel):
        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.mse_loss(self(x), y)

    class Starts(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, *args: object) -> None:
            self.times.append(time.perf_counter())

    torch.manual_seed(0)
    data, starts = Sequences(16 * (steps + 1)), Starts()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SpotPipelineStrategy(pipeline_stages=2, microbatches=4),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[starts],
    )
    trainer.fit(
        Model(optimizer="sgd", num_layers=8, width=width), DataLoader(data, batch_size=16, collate_fn=data.collate)
    )
    if trainer.global_rank == 0:
        periods = [b - a for a, b in zip(starts.times[10:], starts.times[11:])]
        print(f"RESULT {statistics.median(periods) * 1000:.2f}")


def alternating_medians(commands: dict[str, list[str]], rounds: int) -> dict[str, float]:
    """Run each command (a worker that prints ``RESULT <value>``) ``rounds`` times, in turn, so that the machine's
    drift falls on all of them: the median value of each."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    results: dict[str, list[float]] = {kind: [] for kind in commands}
    for _ in range(rounds):
        for kind, command in commands.items():
            out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=True).stdout
            results[kind].append(float(next(line.split()[1] for line in out.splitlines() if line.startswith("RESULT"))))
    return {kind: statistics.median(values) for kind, values in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--worker", choices=["fixed", "vary"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker == "vary", args.width, args.steps)
        return
    shape = ["--width", str(args.width), "--steps", str(args.steps)]
    commands = {kind: [sys.executable, __file__, "--worker", kind, *shape] for kind in ("fixed", "vary")}
    medians = alternating_medians(commands, args.repeats)
    fixed, vary = medians["fixed"], medians["vary"]
    print(
        f"width {args.width}: one length {fixed:.2f} ms/step, a new length per batch {vary:.2f} ms/step: {vary / fixed:.3f}x"
    )


if __name__ == "__main__":
    main()
