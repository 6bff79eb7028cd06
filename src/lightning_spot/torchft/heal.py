"""A joining pipeline takes the state of the same stage of a live one: a Lightning checkpoint, in memory.

    state = stage_state(trainer)                 # on a live peer, at the start of a step (torchft sends it)
    checkpoint = apply_stage_state(module, optimizers, aliases, state)  # on the joiner; loops left to Lightning

The state is what a durable checkpoint of the stage holds (:func:`~lightning_spot.checkpoint.payload.split_checkpoint`:
parameters and optimizer state under stored names, random state, Lightning's loops and callbacks). The tensors are
the live ones, not copies: torchft serves them until the peer's ``should_commit``, which waits for the transfer to
end, and nothing changes them before that (the update comes after the commit; a GPU's are copied to the host by
torchft's transport). Stage ``k`` heals from stage ``k`` of a pipeline with the same cuts: names match one to one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_spot.checkpoint.durable.read import apply_training_state
from lightning_spot.checkpoint.jsonstate import decode
from lightning_spot.checkpoint.payload import Payload, restore_rng, restored_lightning, split_checkpoint

if TYPE_CHECKING:
    import lightning.pytorch as pl

#: the checkpoint path that makes Lightning restore the healed state (see ``ReplicaGroup.resume_hook``)
HEAL_URL = "torchft://peer"


def stage_state(trainer: pl.Trainer) -> dict[str, Any]:
    """This rank's training state as of now, for a joining peer (its tensors: the live ones, see above)."""
    checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    before_fetched_batch(checkpoint.get("loops", {}).get("fit_loop", {}))
    aliases: dict[str, str] = getattr(trainer.strategy, "tied_aliases", {})
    payload = split_checkpoint(checkpoint, copy=False, with_lightning=True, aliases=aliases)
    return {
        "tensors": payload.tensors,
        "optimizer_values": payload.optimizer_values,
        "rng": payload.rng,
        "lightning": payload.lightning,
    }


def before_fetched_batch(fit_loop: dict[str, Any]) -> None:
    """A peer's state is taken inside its next step: Lightning has fetched (and started) that step's batch, not
    trained it, and its counters say so (``ready`` one ahead of ``processed``). Restored as they are, Lightning sees
    no restart point it knows: the joiner's loop is right, but its totals keep that batch counted as fetched, and
    its next checkpoint restores one batch behind (data and ``batch_idx``: a later resume repeats a batch). The
    counters are set back to before that fetch (``ready`` and ``started`` = ``processed``): a state between two
    batches, which Lightning restores as such (the batch comes next; validation that was due has run)."""
    progress = fit_loop.get("epoch_loop.batch_progress")
    if not progress:
        return
    for counts in (progress["total"], progress["current"]):
        if counts["ready"] > counts["processed"]:
            counts["ready"] = counts["started"] = counts["processed"]
            progress["is_last_batch"] = False


def apply_stage_state(
    module: nn.Module, optimizers: list[torch.optim.Optimizer], aliases: dict[str, str], state: dict[str, Any]
) -> dict[str, Any]:
    """Set this rank's weights, optimizer state and random state from a peer's (``aliases``: tied copies -> the
    stored name); return the Lightning checkpoint (loops, callbacks, schedulers) for Lightning to restore."""
    got = Payload(**state)
    values = [decode(v) for v in got.optimizer_values]
    apply_training_state(module, optimizers, got.tensors, values, aliases)
    restore_rng(got.rng)
    return restored_lightning(got.lightning, module, aliases, got.tensors)
