"""Lightning callbacks that assume the whole module on every process, adapted to this rank's stages.

* Weight averaging, ``WeightAveraging`` (``EMAWeightAveraging``) and ``StochasticWeightAveraging``: both copy the
  whole module when fit sets up, before the strategy keeps this rank's stages only, and their copy then pairs the
  wrong tensors with the module's (their updates and swaps zip the two modules' parameters in order). Each gets a
  copy of this rank's stages instead (the whole copy is freed). Checkpoints keep their states like the model
  (``checkpoint/model_copies.py``), so a run resumes onto any layout with its average.
* Finetuning, ``BaseFinetuning`` (``BackboneFinetuning``): unfreezing a module adds a parameter group to the
  optimizer, on the ranks that hold some of its parameters only; later changes address the groups by position
  (``param_groups[-1]``), which on the other ranks is the model's own group. Every rank now adds the group (empty
  where the rank holds none of the module), as one process does.
* The model summary, ``ModelSummary``: figures of the whole model (``runtime/model_summary.py``).
* Prediction writers, ``BasePredictionWriter``: every rank of a pipeline has its predictions; only the pipeline's
  first rank writes them (one writer per replica, as DDP has one per process), not each stage's rank alike.

    on_stages(trainer, module, engine, streamed)  # after placement, in the strategy's setup, when fitting
    writers_once_per_pipeline(trainer, pp_rank)  # in the strategy's setup
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from copy import deepcopy
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import callbacks
from lightning.pytorch.callbacks import BaseFinetuning, BasePredictionWriter, StochasticWeightAveraging
from torch import nn
from torch.optim import Optimizer

from lightning_spot.runtime.engine import PipelineEngine
from lightning_spot.runtime.model_summary import whole_model_summaries

#: the callbacks' base class (``None`` in a Lightning without it)
WeightAveraging: type | None = getattr(callbacks, "WeightAveraging", None)

#: what the callbacks keep and :func:`average_stages` sets (Lightning 2.6's names)
_ATTRIBUTES = ("_average_model", "_device", "_use_buffers", "_kwargs")


def on_stages(trainer: pl.Trainer, module: pl.LightningModule, engine: PipelineEngine, streamed: bool) -> None:
    """Adapt the trainer's callbacks to this rank's stages (see above). Averages are kept on the rank's device unless a
    callback names one, in host memory with ``streamed`` weights (``offload="parameters"``)."""
    average_stages(trainer, module, torch.device("cpu") if streamed else engine.ctx.device)
    whole_model_summaries(trainer, engine.sum_over_pipeline, {id(p) for p in engine.ties.duplicates})
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, BaseFinetuning):  # (wrapped again at each fit: the class's methods, this trainer)
            finetuning: Any = callback
            cls = type(callback)
            finetuning.unfreeze_and_add_param_group = _grouping_on_every_rank(cls.unfreeze_and_add_param_group)
            finetuning.load_state_dict = _restoring_groups_on_every_rank(callback, trainer)


def writers_once_per_pipeline(trainer: pl.Trainer, pp_rank: int) -> None:
    """Prediction writers write on the first rank of each pipeline only (``pp_rank``: this rank's place in it)."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, BasePredictionWriter):
            writer: Any = callback
            cls = type(callback)
            for hook in ("write_on_batch_end", "write_on_epoch_end"):  # (set again at each run, from the class)
                setattr(writer, hook, getattr(cls, hook).__get__(writer) if pp_rank == 0 else _skip)


def _skip(*args: Any, **kwargs: Any) -> None:
    """What a prediction writer does on the pipeline's other ranks."""


def _grouping_on_every_rank(unfreeze: Callable[..., None]) -> Callable[..., None]:
    """``BaseFinetuning.unfreeze_and_add_param_group`` that adds an empty group where this rank holds none of the
    modules' parameters (the ranks that hold them add theirs), with the learning rate the others' get."""

    def unfreeze_and_add_param_group(
        modules: nn.Module | Iterable[Any],
        optimizer: Optimizer,
        lr: float | None = None,
        initial_denom_lr: float = 10.0,
        train_bn: bool = True,
    ) -> None:
        groups = len(optimizer.param_groups)
        unfreeze(modules, optimizer, lr=lr, initial_denom_lr=initial_denom_lr, train_bn=train_bn)
        held = any(True for m in BaseFinetuning.flatten_modules(modules) for _ in m.parameters(recurse=False))
        if len(optimizer.param_groups) == groups and not held:
            rate = optimizer.param_groups[0]["lr"] / initial_denom_lr if lr is None else float(lr)
            optimizer.add_param_group({"params": [], "lr": rate})

    return unfreeze_and_add_param_group


def _restoring_groups_on_every_rank(callback: BaseFinetuning, trainer: pl.Trainer) -> Callable[[dict], None]:
    """``BaseFinetuning.load_state_dict``, which leaves the optimizers' groups it saved to be rebuilt in
    ``on_fit_start``: that hook has passed when a strategy restores after its setup (as this one does), so they are
    rebuilt here. They hold rank 0's parameter names only (callback states come from rank 0): each rank keeps the
    names it holds, and the parameters its own groups from ``configure_optimizers`` hold, so that every rank gets
    the saved groups in order, with its own parameters (a group may be empty)."""
    original = type(callback).load_state_dict.__get__(callback)

    def load_state_dict(state_dict: dict[str, Any]) -> None:
        original(state_dict)
        saved = callback._internal_optimizer_metadata
        if not (callback._restarting and saved and trainer.optimizers):
            return
        named = dict(trainer.lightning_module.named_parameters())
        for index, optimizer in enumerate(trainer.optimizers):
            if index not in saved:
                continue
            groups = []
            for position, group in enumerate(saved[index]):
                own = optimizer.param_groups[position]["params"] if position < len(optimizer.param_groups) else []
                held = [named[name] for name in group["params"] if name in named]
                ids = {id(p) for p in held}
                params = held + [p for p in own if id(p) not in ids]
                groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
            optimizer.param_groups = groups
        callback._restarting = False

    return load_state_dict


def average_stages(trainer: pl.Trainer, module: pl.LightningModule, device: Any) -> None:
    """Give every weight-averaging callback that holds a copy of the module a copy of this rank's stages (an
    ``AveragedModel`` on ``device`` unless the callback names one; SWA: the module itself, as it copies it)."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        averaging: Any = callback  # (its attributes are Lightning's private ones, checked below)
        if getattr(averaging, "_average_model", None) is None:
            continue
        if isinstance(callback, StochasticWeightAveraging):
            averaging._average_model = None
            averaging._average_model = deepcopy(module)
            continue
        if WeightAveraging is None or not isinstance(callback, WeightAveraging):
            continue
        if not all(hasattr(averaging, name) for name in _ATTRIBUTES):
            raise RuntimeError(
                f"spot_pipeline: this Lightning's {type(callback).__name__} keeps its averaged model differently "
                f"than lightning-spot expects ({', '.join(_ATTRIBUTES)}); use Lightning 2.6 or leave the callback out"
            )
        from torch.optim.swa_utils import AveragedModel

        averaging._average_model = None  # (the copy of the whole module goes before the stages' is made)
        averaging._average_model = AveragedModel(
            model=module, device=averaging._device or device, use_buffers=averaging._use_buffers, **averaging._kwargs
        )
