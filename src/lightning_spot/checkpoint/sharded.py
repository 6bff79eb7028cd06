"""Save and load a sharded, layout-independent checkpoint with ``torch.distributed.checkpoint``.

    save_sharded(path, module, optimizers, extra)      # collective: every rank calls it
    extra = load_sharded(path, module, optimizers)     # onto any layout: resharded by parameter name

Each rank writes the parameters and optimizer state of its own stages, keyed by their original
names (data-parallel replicas are written once); the optimizer state is flattened so that it can
be read back when the layer split changes. ``extra`` (Lightning's loop and callback state) is
written by rank 0 next to the shards.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

EXTRA_FILE = "lightning_state.pt"
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state keyed by parameter name (flattened), readable by any layout."""
    return get_optimizer_state_dict(module, optimizer, options=FLAT)


def save_sharded(
    path: str | Path,
    model_state: dict[str, Any],
    optimizer_states: Sequence[dict[str, Any]],
    extra: dict[str, Any],
) -> None:
    """Write one checkpoint directory; every rank must call this."""
    path = Path(path)
    if _rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    state = {"model": model_state, **{f"optimizer_{i}": s for i, s in enumerate(optimizer_states)}}
    dcp.save(state, checkpoint_id=str(path))
    if _rank() == 0:
        torch.save(extra, path / EXTRA_FILE)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def is_sharded_checkpoint(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file() and (path / EXTRA_FILE).is_file()


def load_sharded(path: str | Path, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> dict[str, Any]:
    """Load model and optimizer state for this rank's stages from ``path``; return the extra state."""
    path = Path(path)
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(
            f"{path} is not a lightning-spot sharded checkpoint (a directory with '.metadata' and {EXTRA_FILE}). "
            f"Pass the directory that ModelCheckpoint wrote, e.g. '.../epoch=0-step=100.ckpt'."
        )
    state: dict[str, Any] = {"model": get_model_state_dict(module)}
    for i, opt in enumerate(optimizers):
        state[f"optimizer_{i}"] = optimizer_state(module, opt)
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(module, state["model"])
    for i, opt in enumerate(optimizers):
        set_optimizer_state_dict(module, opt, state[f"optimizer_{i}"], options=FLAT)
    # Lightning's own loop/callback state, written by this package (a trusted path, like any .ckpt)
    return torch.load(path / EXTRA_FILE, map_location="cpu", weights_only=False)
