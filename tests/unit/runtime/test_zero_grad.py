"""A step takes the memory of the previous step's gradients when Lightning zeroes them unread after it
(``runtime/zero_grad.py``): released before the schedule, kept when a hook could still read them."""

from __future__ import annotations

import weakref
from typing import Any

import lightning as L
import torch

from tests.models import TinyPipelineModel, fit_in_this_process, make_loader


class WatchesGrads(TinyPipelineModel):
    """Notes, in every training step (the schedule replays it per micro-batch), how many of the gradients the last
    backward left are still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref] = []
        #: per batch, the counts its training steps saw
        self.alive: dict[int, set[int]] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.alive.setdefault(batch_idx, set()).add(sum(ref() is not None for ref in self.refs))
        return super().training_step(batch, batch_idx)

    def on_after_backward(self) -> None:
        self.refs = [weakref.ref(p.grad) for p in self.parameters() if p.grad is not None]


class ReadsOldGrads(L.Callback):
    """Reads the gradients in ``on_before_zero_grad`` (the previous step's, in plain Lightning)."""

    def __init__(self) -> None:
        self.used: list[list[torch.Tensor]] = []
        self.seen: list[list[torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.used.append([p.grad.clone() for p in pl_module.parameters()])

    def on_before_zero_grad(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.seen.append([p.grad.clone() for p in pl_module.parameters() if p.grad is not None])


def test_the_previous_gradients_are_released_before_the_schedule(tmp_path) -> None:
    model = WatchesGrads()
    fit_in_this_process(tmp_path, model, make_loader(), max_steps=4)
    assert len(model.refs) == len(list(model.parameters()))
    assert model.alive == {0: {0}, 1: {0}, 2: {0}, 3: {0}}


def test_a_hook_that_reads_the_gradients_before_zero_grad_keeps_them(tmp_path) -> None:
    model, reader = WatchesGrads(), ReadsOldGrads()
    fit_in_this_process(tmp_path, model, make_loader(), max_steps=4, callbacks=[reader])
    params = len(list(model.parameters()))
    assert model.alive == {0: {0}, 1: {params}, 2: {params}, 3: {params}}
    # as in plain Lightning: step k's hook sees the gradients that step k - 1 updated with
    assert [len(grads) for grads in reader.seen] == [0, params, params, params]
    for seen, used in zip(reader.seen[1:], reader.used):
        assert all(torch.equal(a, b) for a, b in zip(seen, used))


def test_accumulated_gradients_are_kept(tmp_path) -> None:
    model = WatchesGrads()
    fit_in_this_process(tmp_path, model, make_loader(), max_steps=2, accumulate_grad_batches=2)
    params = len(list(model.parameters()))
    # the second batch of each window adds to the first one's gradients
    assert model.alive[1] == {params} and model.alive[3] == {params}, model.alive
