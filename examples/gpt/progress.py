"""The demo's progress bar: Lightning's, with an epoch count that reads right when only ``max_steps`` bounds the run.

    trainer = L.Trainer(max_steps=120, callbacks=[*progress_bar()])   # "Epoch 3/7", not "Epoch 3/-2"

Lightning 2.6's rich bar writes ``Epoch {epoch}/{max_epochs - 1}``; a run bounded by steps has ``max_epochs=-1``
and reads "Epoch 3/-2". Here the last epoch shown is the one in which ``max_steps`` falls (from the epoch's
batches and ``accumulate_grad_batches``), or none if the epoch's length is unknown (a stream).
"""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch.callbacks import Callback


def last_epoch(trainer: Any, epoch: int) -> int | None:
    """The index of the run's last epoch: ``max_epochs - 1``, or, for a run bounded by ``max_steps`` alone, the
    epoch in which it ends (``None``: the epoch's length is unknown)."""
    if trainer.max_epochs is not None and trainer.max_epochs >= 0:
        return int(trainer.max_epochs) - 1
    batches = trainer.num_training_batches
    if trainer.max_steps < 0 or not math.isfinite(batches) or batches <= 0:
        return None
    steps_per_epoch = max(1.0, batches / trainer.accumulate_grad_batches)
    return epoch + max(0, math.ceil((trainer.max_steps - trainer.global_step) / steps_per_epoch) - 1)


def progress_bar() -> list[Callback]:
    """Lightning's rich bar with the epoch count above, where rich is installed (else Lightning's default)."""
    try:
        from lightning.pytorch.callbacks import RichProgressBar
    except ImportError:  # pragma: no cover
        return []

    class StepsBoundProgressBar(RichProgressBar):
        def _get_train_description(self, current_epoch: int) -> str:
            last = last_epoch(self.trainer, current_epoch)
            description = f"Epoch {current_epoch}" if last is None else f"Epoch {current_epoch}/{last}"
            return f"{description:{len(self.validation_description)}}"  # (Lightning's padding against flicker)

    try:
        return [StepsBoundProgressBar()]
    except ModuleNotFoundError:  # rich is not installed: Lightning's tqdm bar shows no last epoch anyway
        return []
