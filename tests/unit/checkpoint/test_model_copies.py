"""Checkpoint entries that copy the model's state (``checkpoint/model_copies.py``) and the order of callbacks."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import torch
from torch import nn

from lightning_spot import SpotCheckpoint
from lightning_spot.checkpoint.callback import checkpoints_last
from lightning_spot.checkpoint.jsonstate import decode
from lightning_spot.checkpoint.model_copies import group_of
from lightning_spot.checkpoint.payload import restored_lightning, split_checkpoint


def _last_stage() -> nn.Module:
    """The last stage of a model whose head is tied to the embedding (stored under ``embed.weight``)."""
    stage = nn.Module()
    stage.head = nn.Linear(4, 4, bias=False)
    stage.register_buffer("seen", torch.tensor(3.0))
    return stage


def test_a_copy_of_the_model_state_goes_with_the_model_under_stored_names_and_comes_back_under_local_ones() -> None:
    stage, aliases = _last_stage(), {"head.weight": "embed.weight"}
    trained = {"embed.weight": torch.randn(4, 4), "seen": torch.tensor(3.0)}  # (the strategy's stored names)
    average = {"head.weight": torch.randn(4, 4), "seen": torch.tensor(2.0)}  # (EMAWeightAveraging: local names)
    checkpoint = {
        "state_dict": average,
        "current_model_state": trained,
        "averaging_state": {"n_averaged": torch.tensor(5)},  # not the model's names: JSON, as before
        "ema_of_some": {"head.weight": torch.randn(4, 4)},  # a subset of the names: not a copy
        "global_step": 7,
    }
    share = split_checkpoint(checkpoint, copy=True, with_lightning=True, aliases=aliases)
    copied = group_of(("current_model_state",))
    assert set(share.tensors) == {"model", copied}
    assert set(share.tensors["model"]) == {"embed.weight", "seen"}, "the average, under the stored name"
    assert torch.equal(share.tensors[copied]["embed.weight"], trained["embed.weight"])
    assert share.lightning["current_model_state"] == {"__model_copy__": True}
    assert decode(share.lightning["averaging_state"])["n_averaged"] == 5
    assert "ema_of_some" in share.lightning and "ema_of_some" not in share.tensors

    # restored: the module holds the average (read as the model); the entry comes back under this rank's names
    stage.load_state_dict({"head.weight": average["head.weight"], "seen": average["seen"]})
    restored = restored_lightning(share.lightning, stage, aliases, share.tensors)
    assert set(restored["current_model_state"]) == {"head.weight", "seen"}
    assert torch.equal(restored["current_model_state"]["head.weight"], trained["embed.weight"])
    assert torch.equal(restored["state_dict"]["head.weight"], average["head.weight"])
    assert restored["global_step"] == 7


def test_a_copy_inside_a_callbacks_state_is_found_at_its_path() -> None:
    """StochasticWeightAveraging keeps its average in its callback state (a key with any characters)."""
    stage = _last_stage()
    key = "StochasticWeightAveraging{'swa_lrs': 0.01, 'monitor': 'val/loss'}"
    average = {"head.weight": torch.randn(4, 4), "seen": torch.tensor(1.0)}
    swa = {"n_averaged": 2, "average_model_state": average, "scheduler_state": {"__private": 1}}
    checkpoint = {"state_dict": stage.state_dict(), "callbacks": {key: swa}}
    share = split_checkpoint(checkpoint, copy=False, with_lightning=True)
    path = ("callbacks", key, "average_model_state")
    assert set(share.tensors) == {"model", group_of(path)} and "/" not in group_of(path)
    assert share.lightning["callbacks"][key]["average_model_state"] == {"__model_copy__": True}
    assert checkpoint["callbacks"][key]["average_model_state"] is average, "the checkpoint itself is unchanged"
    restored = restored_lightning(share.lightning, stage, {}, share.tensors)
    state = restored["callbacks"][key]
    assert torch.equal(state["average_model_state"]["head.weight"], average["head.weight"])
    assert state["n_averaged"] == 2 and state["scheduler_state"] == {"__private": 1}


def test_a_checkpoint_without_copies_is_restored_as_before() -> None:
    stage = _last_stage()
    share = split_checkpoint({"state_dict": stage.state_dict(), "epoch": 1}, copy=False, with_lightning=True)
    assert set(share.tensors) == {"model"}
    assert restored_lightning(share.lightning, stage, {}, share.tensors) == {
        "epoch": 1,
        "state_dict": {},
        "optimizer_states": [],
    }


def test_spot_checkpoint_runs_after_the_other_callbacks() -> None:
    """As Lightning orders its own checkpoint callbacks: a step's checkpoint holds what the others changed at the
    step's end (an average of the weights updated in on_train_batch_end)."""
    spot, first, second = SpotCheckpoint(), L.Callback(), L.Callback()
    trainer = SimpleNamespace(callbacks=[spot, first, second])
    checkpoints_last(trainer)  # type: ignore[arg-type]
    assert trainer.callbacks == [first, second, spot]
    checkpoints_last(trainer)  # type: ignore[arg-type]
    assert trainer.callbacks == [first, second, spot]
