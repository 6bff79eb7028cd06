"""A training step's ``self.log`` values held until the step counts: what a torchft step logs.

    held = HeldLogs(module, share, device, holds_last)   # engine.held_logs: its train steps replay nothing
    ...                                                  # train step (last stage): the user's records combined
    held.packed                                          # over its micro-batches, to be summed over the quorum
    held.hold(logged, batch_size, shown)                 # (every rank) the rest of what the step logs
    held.replay()                                        # the step committed: logged once, on every rank
    held.drop()                                          # it did not: it logs nothing (it is run again)

A step that a peer's loss interrupts is run again with a new quorum; its values are logged only once, by the run
that commits (epoch means and torchmetrics count every step once). The user's values are summed over the quorum's
pipelines with the gradients (riders of the last bucket): each pipeline logs the whole global batch's value, as
one process would, not the value of its own rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_spot.runtime.logging_bridge import LastStageShare, PackedLogs, replay

#: in a step's shared values: how many user values wait for the quorum (the other stages then take them too)
HELD = "__held__"


class HeldLogs:
    """The logged values of the step in flight, replayed through ``LightningModule.log`` once it commits."""

    def __init__(self, module: nn.Module, share: LastStageShare, device: torch.device, holds_last: bool) -> None:
        self.module = module
        #: the last stage's values to the other stages of the pipeline (a share of its own: its names stay known)
        self.share = share
        self.device = device
        self.holds_last = holds_last
        #: the last stage's user values of the step in flight, summed over the quorum in place before it commits
        self.packed: PackedLogs | None = None
        self._step: tuple[dict[str, tuple[Any, dict[str, Any]]], int, Callable[..., Any]] | None = None

    def hold(self, logged: dict[str, tuple[Any, dict[str, Any]]], batch_size: int, shown: Callable[..., Any]) -> None:
        """What the step logs besides the user's quorum values (``HELD`` among them), until it commits."""
        self._step = (logged, batch_size, shown)

    def drop(self) -> None:
        self.packed = self._step = None

    def replay(self) -> None:
        """Log the committed step on this rank: its values, and the user's values summed over the quorum (sent
        from the last stage to the others)."""
        step, packed = self._step, self.packed
        self.drop()
        if step is None:
            return
        logged, batch_size, shown = step
        held = logged.pop(HELD, (0.0, {}))[0]
        if held:
            user = packed.values() if self.holds_last and packed is not None else None
            logged = {**logged, **self.share.logged(user)}
        module: Any = self.module
        previous = module._current_fx_name
        module._current_fx_name = "training_step"  # (Lightning is inside the optimizer step by now)
        try:
            replay(module, logged, batch_size=batch_size, device=self.device, shown=shown)
        finally:
            module._current_fx_name = previous
