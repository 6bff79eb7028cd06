"""Lightning's model summary of a pipelined module: the whole model's figures, and sizes from ``example_input_array``.

Lightning's ``ModelSummary`` callback summarizes the module on every rank when fit starts (rank 0 prints it). On a
pipeline rank the module holds its stages and stand-ins for the others' modules, so

* with ``example_input_array`` set, its forward stopped the run: a stand-in gives meta tensors, which the rank's
  own modules cannot take (``Tensor on device cpu is not on the expected device meta``). The summary reads shapes
  only: under :func:`~lightning_spot.partition.stage_run.shapes_only` stand-ins give zeros where the input is;
* the parameters, FLOPs and types it showed were rank 0's (a four-stage model showed a quarter of its parameters as
  its total, its head as a ``RemoteModule``). Each row's and the totals' figures are summed over the pipeline's
  ranks (a tied weight counted once in the totals, the FLOPs of stand-ins, computed on meta tensors, left out), and
  a stand-in's type is its module's.

    whole_model_summaries(trainer, reduce, duplicates)   # in the strategy's setup, when fitting
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelSummary
from torch import Tensor

from lightning_spot.partition.stage_run import RemoteModule, shapes_only


def whole_model_summaries(trainer: pl.Trainer, reduce: Callable[[Tensor], Tensor], duplicates: set[int]) -> None:
    """Make the trainer's ``ModelSummary`` callbacks summarize the whole model (``reduce``: the sum of a tensor over the
    pipeline's ranks; ``duplicates``: ids of parameters that copy a tied one held by another stage)."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, ModelSummary):
            summarize = type(callback)._summary

            def _summary(
                trainer: pl.Trainer, pl_module: pl.LightningModule, cb: Any = callback, summarize: Any = summarize
            ) -> Any:
                with shapes_only():
                    summary = summarize(cb, trainer, pl_module)
                return _whole(summary, pl_module, reduce, duplicates)

            callback._summary = _summary  # type: ignore[method-assign]


def _whole(summary: Any, module: pl.LightningModule, reduce: Callable[[Tensor], Tensor], duplicates: set[int]) -> Any:
    """``summary`` (a ``Summary``) showing the figures of every stage of the pipeline."""
    layers = list(summary._layer_summary.values())
    stand_ins = [isinstance(layer._module, RemoteModule) for layer in layers]
    flops = [sum(counts.values()) for counts in summary.flop_counts.values()]
    own = [0 if stand_in else count for stand_in, count in zip(stand_ins, flops)]
    params = [p for p in module.parameters() if id(p) not in duplicates]
    figures = torch.tensor(
        [
            *summary.param_nums,
            *own,
            sum(p.numel() for p in params),
            sum(p.numel() for p in params if p.requires_grad),
            summary.total_flops - (sum(flops) - sum(own)),
        ],
        dtype=torch.int64,
    )
    figures = reduce(figures)
    n = len(layers)
    values = figures.tolist()
    rows, row_flops, (total, trainable, total_flops) = values[:n], values[n : 2 * n], values[2 * n :]
    types = [
        type(object.__getattribute__(layer._module, "_meta_module")).__name__ if stand_in else layer.layer_type
        for layer, stand_in in zip(layers, stand_ins)
    ]
    names = list(summary._layer_summary)
    whole = {
        "param_nums": property(lambda self: rows),
        "total_parameters": property(lambda self: total),
        "trainable_parameters": property(lambda self: trainable),
        "total_flops": property(lambda self: total_flops),
        "flop_counts": property(lambda self: {name: {"all": f} for name, f in zip(names, row_flops)}),
        "layer_types": property(lambda self: types),
    }
    summary.__class__ = type(f"Pipeline{type(summary).__name__}", (type(summary),), whole)
    return summary
