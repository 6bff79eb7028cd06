"""Train the tiny model a few steps (with validation) and write each rank's process setup.

    python tests/workers/report_setup.py OUT [--devices 2] [--timeline] [--set-threads N]

Launched as a user would: Lightning's launcher starts the other ranks, or torchrun starts all of them.
``--set-threads`` calls ``torch.set_num_threads`` after importing lightning_spot (a user's own choice).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_spot import PipelineTimeline, SpotPipelineStrategy
from tests.models import ReportSetup, TinyPipelineModel, make_loader


class WarningModel(TinyPipelineModel):
    """Logs the validation loss per epoch without sync_dist (the strategy reduces it) and warns once itself."""

    def training_step(self, batch, batch_idx):
        if batch_idx == 0:
            warnings.warn("a genuine warning from the user's training_step", UserWarning, stacklevel=1)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), on_epoch=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--timeline", action="store_true")
    p.add_argument("--set-threads", type=int, default=None)
    args = p.parse_args()
    if args.set_threads:
        torch.set_num_threads(args.set_threads)
    callbacks: list[L.Callback] = [ReportSetup(args.out)]
    if args.timeline:
        callbacks.append(
            PipelineTimeline(dirpath=str(Path(args.out) / "timeline"), start_step=1, num_steps=1, gantt=False)
        )
    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=SpotPipelineStrategy(pipeline_stages=2, microbatches=2, schedule="gpipe"),
        max_steps=4,
        val_check_interval=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(WarningModel(), make_loader(batch_size=16), make_loader(batch_size=16, n=32))


if __name__ == "__main__":
    main()
