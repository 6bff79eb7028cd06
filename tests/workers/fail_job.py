"""Worker: a job in which something fails on one rank; every rank must stop within seconds.

python tests/workers/fail_job.py KIND OUT_DIR

KIND: ``step`` (training_step raises on the last stage at step 3), ``callback`` (a callback raises on rank 1 at
step 3), ``upload`` (rank 1 may not write checkpoint data: the save of step 2 fails there), ``freeze`` (rank 1
stops itself with SIGSTOP at step 4: a node that vanished without closing its sockets), ``sigterm`` (no
``SpotCheckpoint``: rank 1 alone gets SIGTERM at step 3, Lightning's own stop; every rank writes the step it ended
at in ``OUT_DIR/stopped-RANK.json``). The failing rank writes ``OUT_DIR/failed.json`` (rank, time) just before it fails.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L

import tests.fakefs  # noqa: F401  (registers deniedfile://)
from lightning_spot import SpotCheckpoint, SpotPipelineStrategy
from tests.models import TinyPipelineModel, make_loader

KIND, OUT = sys.argv[1], Path(sys.argv[2])
RANK = int(os.environ["RANK"])
FAILING_RANK = 1


def mark_failure() -> None:
    (OUT / "failed.json").write_text(json.dumps({"rank": RANK, "time": time.time()}))


class FailingStep(TinyPipelineModel):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.global_step == 3 and self.trainer.strategy.engine.holds_last:  # type: ignore[attr-defined]
            mark_failure()
            raise ValueError("boom in training_step at step 3")
        return super().training_step(batch, batch_idx)


class FailOnRank(L.Callback):
    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if RANK == FAILING_RANK and KIND == "freeze" and trainer.global_step == 4:
            mark_failure()
            os.kill(os.getpid(), signal.SIGSTOP)
        if RANK == FAILING_RANK and KIND == "sigterm" and trainer.global_step == 3:
            mark_failure()
            os.kill(os.getpid(), signal.SIGTERM)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if KIND == "sigterm":
            stopped = {"step": trainer.global_step, "error": type(exception).__name__}
            (OUT / f"stopped-{RANK}.json").write_text(json.dumps(stopped))

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if RANK == FAILING_RANK and KIND == "callback" and trainer.global_step == 3:
            mark_failure()
            raise RuntimeError("boom in a callback on rank 1")


class MarkSave(SpotCheckpoint):
    def save(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> Any:
        if RANK == FAILING_RANK and not (OUT / "failed.json").exists():
            mark_failure()
        return super().save(trainer, *args, **kwargs)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    model = FailingStep() if KIND == "step" else TinyPipelineModel()
    dirpath = f"deniedfile://{OUT / 'ckpt'}" if KIND == "upload" else str(OUT / "ckpt")
    checkpoint = MarkSave if KIND == "upload" else SpotCheckpoint
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=SpotPipelineStrategy(pipeline_stages=2, microbatches=2, step_timeout=3.0),
        max_steps=30,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[FailOnRank()]
        + ([] if KIND == "sigterm" else [checkpoint(dirpath=dirpath, every_n_train_steps=2, save_on_train_end=False)]),
    )
    trainer.fit(model, make_loader(batch_size=8, n=256))


if __name__ == "__main__":
    main()
