"""Worker: one pipeline (replica group) of a torchft job; saves its final parameters.

python tests/workers/ft_train.py OUT_DIR [--die-at STEP] [--die GROUP:RANK:STEP] [--stages P] [--steps N] [--step-sleep S]

Environment: TORCHFT_LIGHTHOUSE, REPLICA_GROUP_ID and the process-group variables of this pipeline alone.
``--die-at STEP``: this pipeline's rank 0 kills itself (SIGKILL) after the forward of step STEP, before its gradients
reach the others (the survivors' all-reduce of that step fails and the step is run again without it).
``--die GROUP:RANK:STEP[,...]``: that rank of that pipeline kills itself the same way, once each (a marker in
OUT_DIR keeps its restart alive). A process that took a peer's state adds a line to ``OUT_DIR/heals.jsonl``. Every process writes ``OUT_DIR/started/group{G}_rank{R}_{pid}`` when it starts.
``--step-sleep S``: sleep S seconds after every step (time for a replacement to start and join).
Writes ``OUT_DIR/group{G}_rank{R}.pt`` (parameters, global step, pid, steps discarded, quorum changes, the step it
took a peer's state at, and the wall-clock time each step ended).
"""

from __future__ import annotations

import argparse
import json
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
GROUP = os.environ.get("REPLICA_GROUP_ID", "?")


class Report(L.Callback):
    def __init__(self, out: Path, die: list[tuple[str, int, int]], sleep: float) -> None:
        self.out, self.die, self.sleep = out, die, sleep
        self.ended: list[tuple[int, float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.ended.append((trainer.global_step, time.time()))
        time.sleep(self.sleep)

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Any) -> None:
        if (GROUP, trainer.global_rank, trainer.global_step) not in self.die:
            return
        marker = self.out / f"died_group{GROUP}_step{trainer.global_step}"
        if not marker.exists():
            marker.write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        healed = trainer.strategy.restored_manifest or {}  # type: ignore[attr-defined]
        if healed.get("tier") == "peer":
            line = {"group": GROUP, "rank": trainer.global_rank, "time": time.time(), **healed}
            with open(self.out / "heals.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")

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
                "ended": self.ended,
                "healed_at": healed.get("step") if healed.get("tier") == "peer" else None,
            },
            self.out / f"group{GROUP}_rank{trainer.global_rank}.pt",
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--die-at", type=int, default=None)
    parser.add_argument("--die", default=None)
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    args = parser.parse_args()
    started = args.out / "started"
    started.mkdir(parents=True, exist_ok=True)
    (started / f"group{GROUP}_rank{os.environ['RANK']}_{os.getpid()}").touch()
    die = [(GROUP, 0, args.die_at)] if args.die_at is not None else []
    for spec in args.die.split(",") if args.die else []:
        group, rank, step = spec.split(":")
        die.append((group, int(rank), int(step)))
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
        callbacks=[Report(args.out, die, args.step_sleep)],
    )
    trainer.fit(model, make_loader(batch_size=BATCH, n=SAMPLES))


if __name__ == "__main__":
    main()
