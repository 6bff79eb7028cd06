"""Worker: one pipeline (replica group) of a torchft job; saves its final parameters.

python tests/workers/ft_train.py OUT_DIR [--die-at STEP] [--stages P] [--steps N] [--step-sleep S]

Environment: TORCHFT_LIGHTHOUSE, REPLICA_GROUP_ID and the process-group variables of this pipeline alone.
``--die-at STEP``: this pipeline's rank 0 kills itself (SIGKILL) after the forward of step STEP, before its gradients
reach the others (the survivors' all-reduce of that step fails and the step is run again without it).
``--step-sleep S``: sleep S seconds after every step (time for a replacement to start and join).
Writes ``OUT_DIR/group{G}_rank{R}.pt`` (parameters, global step, pid, steps discarded, quorum changes).
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_spot import SpotPipelineStrategy
from tests.models import make_loader, make_model

BATCH, SAMPLES, STEPS = 12, 96, 10


class Report(L.Callback):
    def __init__(self, out: Path, die_at: int | None, sleep: float) -> None:
        self.out, self.die_at, self.sleep = out, die_at, sleep

    def on_train_batch_end(self, *args: Any) -> None:
        time.sleep(self.sleep)

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Any) -> None:
        if self.die_at is not None and trainer.global_step == self.die_at and trainer.global_rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        replicas = trainer.strategy.replicas  # type: ignore[attr-defined]
        healed = trainer.strategy.restored_manifest or {}  # type: ignore[attr-defined]
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "state_dict": pl_module.state_dict(),
                "global_step": trainer.global_step,
                "pid": os.getpid(),
                "discarded": replicas.discarded,
                "quorum_changes": replicas.quorum_changes,
                "healed_at": healed.get("step") if healed.get("tier") == "peer" else None,
            },
            self.out / f"group{os.environ['REPLICA_GROUP_ID']}_rank{trainer.global_rank}.pt",
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--die-at", type=int, default=None)
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    args = parser.parse_args()
    model = make_model(seed=7)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=SpotPipelineStrategy(pipeline_stages=args.stages, microbatches=2, fault_tolerance="torchft"),
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[Report(args.out, args.die_at, args.step_sleep)],
    )
    trainer.fit(model, make_loader(batch_size=BATCH, n=SAMPLES))


if __name__ == "__main__":
    main()
