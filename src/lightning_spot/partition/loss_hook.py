"""The optional loss hook of the model contract, interpreted in one place.

    if has_loss_hook(module):
        loss = run_loss_hook(module, batch)          # module.pipeline_loss(module(*inputs), batch)
        inputs = loss_hook_inputs(module, batch)     # what ``self(...)`` is called with

A module that defines ``pipeline_loss(output, batch)`` is trained as ``pipeline_loss(self(*inputs),
batch)`` instead of through ``training_step``; ``pipeline_inputs(batch)`` gives the forward inputs
(default: the first element of a tuple/list batch, or the batch itself).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from torch import nn


def has_loss_hook(module: nn.Module) -> bool:
    """Whether ``module`` defines ``pipeline_loss``."""
    return callable(getattr(module, "pipeline_loss", None))


def loss_hook_inputs(module: nn.Module, batch: Any) -> tuple[Any, ...]:
    """The positional arguments of ``module(...)`` for ``batch`` under the loss hook."""
    make_inputs = getattr(module, "pipeline_inputs", None)
    if callable(make_inputs):
        inputs = make_inputs(batch)
    elif isinstance(batch, (tuple, list)):
        inputs = batch[:1]
    else:
        inputs = (batch,)
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def run_loss_hook(module: nn.Module, batch: Any) -> Any:
    """``module.pipeline_loss(module(*loss_hook_inputs(module, batch)), batch)``."""
    loss_fn = cast(Callable[[Any, Any], Any], module.pipeline_loss)
    return loss_fn(module(*loss_hook_inputs(module, batch)), batch)
