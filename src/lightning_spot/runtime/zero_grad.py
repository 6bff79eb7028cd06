"""Whether Lightning zeroes the gradients right after a training step, so that the step may take their memory.

Lightning's automatic optimisation runs ``training_step`` (here: the whole pipeline schedule, forward and
backward), then ``on_before_zero_grad`` and ``optimizer_zero_grad``, then ``backward``. The schedule's gradients
are taken aside while the previous step's are put back for those hooks (``runtime/grads.py``). When the hooks are
Lightning's own and nothing accumulates, nobody reads the previous step's gradients again: they can be released
before the schedule, whose backward then reuses their memory (one set of gradients at the peak instead of two; on
a CPU host, no fresh pages to fault in on every step).
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden


def zeroed_after_step(trainer: pl.Trainer, module: pl.LightningModule) -> bool:
    """Whether the gradients ``.grad`` holds now are zeroed, unread, once the current training step is over."""
    if trainer.accumulate_grad_batches != 1 or trainer.fit_loop._skip_backward:
        return False
    if is_overridden("optimizer_zero_grad", module, pl.LightningModule):
        return False
    if is_overridden("on_before_zero_grad", module, pl.LightningModule):
        return False
    callbacks = getattr(trainer, "callbacks", [])  # (set on the trainer by its callback connector)
    return not any(is_overridden("on_before_zero_grad", callback, pl.Callback) for callback in callbacks)
