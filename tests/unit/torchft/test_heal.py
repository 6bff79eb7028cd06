"""The Lightning state a live peer hands a joiner (taken inside the peer's step) restores at the right batch, and
so does the joiner's own next checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_spot.torchft.heal import before_fetched_batch


class Batches(BoringModel):
    """Records each batch index trained; ``dump_at``: takes the state inside that batch's step, as a peer does."""

    def __init__(self, dump_at: int | None = None, out: Path | None = None) -> None:
        super().__init__()
        self.dump_at, self.out = dump_at, out
        self.seen: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.seen.append(batch_idx)
        if batch_idx == self.dump_at and self.out is not None:
            checkpoint = self.trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            before_fetched_batch(checkpoint["loops"]["fit_loop"])
            torch.save(checkpoint, self.out)
        return super().training_step(batch, batch_idx)


class SaveAfterFirstBatch(L.Callback):
    """Saves a checkpoint at the end of the first batch (where SpotCheckpoint saves: ``on_train_batch_end``)."""

    def __init__(self, path: Path) -> None:
        self.path, self.done = path, False

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if not self.done:
            trainer.save_checkpoint(self.path)
            self.done = True


def _fit(model: Batches, steps: int, ckpt: Path | None = None, callbacks: list[L.Callback] | None = None) -> L.Trainer:
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=callbacks or [],
    )
    trainer.fit(model, ckpt_path=ckpt)
    return trainer


@pytest.mark.filterwarnings("ignore:.*resuming from a checkpoint that ended before the epoch ended")
def test_a_state_taken_inside_a_step_restores_before_that_batch_and_so_does_the_next_checkpoint(tmp_path: Path) -> None:
    """The peer's batch 3 was fetched but not trained when its state was taken: the joiner trains batch 3 next,
    has stepped 3 batches (its logging step), and a checkpoint it saves after that batch resumes at batch 4. (Without
    the counters set back, the joiner's totals kept batch 3 as fetched and that checkpoint resumed at batch 3 again.)"""
    peer_state, joiner_ckpt = tmp_path / "peer.ckpt", tmp_path / "joiner.ckpt"
    _fit(Batches(dump_at=3, out=peer_state), steps=5)
    joiner = Batches()
    trainer = _fit(joiner, steps=5, ckpt=peer_state, callbacks=[SaveAfterFirstBatch(joiner_ckpt)])
    assert joiner.seen == [3, 4]
    assert trainer.fit_loop.epoch_loop._batches_that_stepped == 5
    later = Batches()
    _fit(later, steps=6, ckpt=joiner_ckpt)
    assert later.seen == [4, 5], "the joiner's checkpoint after batch 3 must resume at batch 4"


def test_counters_between_two_batches_are_left_alone() -> None:
    """A state taken between batches (nothing fetched ahead) is not changed."""
    counts = {"ready": 4, "started": 4, "processed": 4, "completed": 3}
    loop = {"epoch_loop.batch_progress": {"total": dict(counts), "current": dict(counts), "is_last_batch": True}}
    before_fetched_batch(loop)
    assert loop["epoch_loop.batch_progress"] == {"total": counts, "current": counts, "is_last_batch": True}
