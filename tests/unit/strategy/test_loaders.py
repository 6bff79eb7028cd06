"""A fit frees the garbage an earlier fit in the same process left (its process groups, in reference cycles) before
its DataLoaders fork their workers: freed inside a worker, a gloo group's destructor waits for threads that were not
forked, and the worker hangs."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import lightning as L

from tests.models import fit_in_this_process, make_loader, make_model


class Left:
    """Stands for what an earlier fit left behind in a reference cycle (a dropped Trainer and its groups)."""

    def __init__(self) -> None:
        self.me = self


class SeesGarbageAtTrainStart(L.Callback):
    """Whether the garbage is still there when training starts (the loaders are made, their workers not forked)."""

    def __init__(self, left: weakref.ref[Any]) -> None:
        self.left = left
        self.alive: bool | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.alive = self.left() is not None


def test_a_fit_frees_the_garbage_of_earlier_fits_before_its_loaders_fork_workers(tmp_path: Path) -> None:
    fit_in_this_process(tmp_path, make_model(), make_loader(), max_steps=1, keep_process_group=True)  # the earlier fit
    enabled = gc.isenabled()
    gc.disable()  # (only an explicit collection frees the cycle)
    try:
        left = Left()
        ref = weakref.ref(left)
        del left
        assert ref() is not None
        seen = SeesGarbageAtTrainStart(ref)
        fit_in_this_process(tmp_path, make_model(), make_loader(num_workers=1), max_steps=1, callbacks=[seen])
    finally:
        if enabled:
            gc.enable()
    assert seen.alive is False
