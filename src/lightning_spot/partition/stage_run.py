"""Run an unchanged LightningModule step function as one pipeline stage.

While a stage runs, the user's ``training_step`` (or ``validation_step`` ...) executes as usual; the
layers of the sequence consult the active :class:`StageRun` to

* take the activation received from the previous stage as the input of the stage's first layer,
* pass through (skip) layers that belong to another stage held by the same rank, and
* stop the step with :class:`StageExit` after the stage's last layer (all stages but the last).

Modules that live on other ranks are replaced by placeholders that compute on the meta device, so
code before the layer sequence (embeddings) still produces correctly shaped values for free.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from lightning_spot.partition.discovery import ModelContractError


class StageExit(BaseException):
    """Raised after a stage's last layer to end the user's step function early (not an error).

    A ``BaseException`` so that a user's ``except Exception`` cannot swallow it.
    """

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output


@dataclass
class StageRun:
    """What the stage currently executing on this rank needs."""

    stage: int
    first_stage: bool
    incoming: tuple[torch.Tensor, ...] | None
    exit_after: bool
    layers_started: bool = False
    finished_layers: bool = False
    meta_args: list[str] = field(default_factory=list)


_ACTIVE: list[StageRun] = []


def active_run() -> StageRun | None:
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def running(run: StageRun) -> Iterator[StageRun]:
    _ACTIVE.append(run)
    try:
        yield run
    finally:
        _ACTIVE.pop()


def _incoming_value(incoming: tuple[torch.Tensor, ...]) -> Any:
    return incoming[0] if len(incoming) == 1 else incoming


def _reject_meta(fqn: str, args: tuple, kwargs: dict) -> None:
    values = list(args) + list(kwargs.values())
    if any(isinstance(v, torch.Tensor) and v.is_meta for v in values):
        raise ModelContractError(
            f"Layer `{fqn}` received a tensor argument computed by modules that live on another pipeline stage "
            f"(it only exists as a shape here). Only the first positional argument travels between stages. "
            f"Compute masks and position tensors inside the layers, or from the raw batch, not from the outputs "
            f"of modules that run before the layer sequence."
        )


def instrument_layer(
    layer: nn.Module, fqn: str, stage: int, *, first: bool, last: bool, checkpoint: bool = False
) -> None:
    """Make an owned layer obey the active :class:`StageRun` (an instance-level ``forward`` override).

    Overriding ``forward`` on the instance keeps parameter names and ``state_dict`` keys unchanged.
    With ``checkpoint``, the layer's activations are recomputed in backward instead of kept.
    """
    original = type(layer).forward

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        run = active_run()
        if run is None:
            return original(self, *args, **kwargs)
        if run.stage != stage:
            return args[0] if args else None
        if first:
            run.layers_started = True
            if run.incoming is not None:
                if not args:
                    raise ModelContractError(
                        f"Layer `{fqn}` was called without a positional input; the layer sequence must pass the "
                        f"hidden state as each layer's first positional argument."
                    )
                args = (_incoming_value(run.incoming), *args[1:])
            if not run.first_stage:
                _reject_meta(fqn, args[1:], kwargs)
        if checkpoint and torch.is_grad_enabled():
            out = torch.utils.checkpoint.checkpoint(original, self, *args, use_reentrant=False, **kwargs)
        else:
            out = original(self, *args, **kwargs)
        if last:
            run.finished_layers = True
            if run.exit_after:
                raise StageExit(out)
        return out

    layer.forward = types.MethodType(forward, layer)


class SkippedLayer(nn.Module):
    """Stands in for a layer that another pipeline stage owns; passes its first input through."""

    def __init__(self, fqn: str) -> None:
        super().__init__()
        self.fqn = fqn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else None

    def extra_repr(self) -> str:
        return f"on another stage: {self.fqn}"


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to("meta") if not value.is_meta else value
    if isinstance(value, (list, tuple)):
        return type(value)(_to_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_meta(v) for k, v in value.items()}
    return value


class RemoteModule(nn.Module):
    """Stands in for a module that lives on another pipeline stage; computes shapes on the meta device.

    It holds a parameter-free meta copy of the original, outside the module tree, so it adds
    nothing to ``parameters()`` or ``state_dict()``.
    """

    def __init__(self, fqn: str, original: nn.Module, owner: str) -> None:
        super().__init__()
        self.fqn = fqn
        self.owner = owner
        meta = original.to("meta") if _all_meta(original) else meta_copy(original)
        object.__setattr__(self, "_meta_module", meta)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        run = active_run()
        if run is not None and (run.first_stage or run.layers_started):
            here = "the first stage" if run.first_stage else f"stage {run.stage}, after the layer sequence"
            raise ModelContractError(
                f"Module `{self.fqn}` was placed on the {self.owner} stage but runs on {here}. Modules with "
                f"parameters registered before the layer sequence go to the first stage, those after it to the "
                f"last stage. Register `{self.fqn}` on the right side of the sequence in __init__, or pass "
                f"`SpotPipelineStrategy(first_stage_modules=[...]` / `last_stage_modules=[...])`."
            )
        return self._meta_module(*_to_meta(args), **_to_meta(kwargs))

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_meta_module"), name)

    def extra_repr(self) -> str:
        return f"on the {self.owner} stage: {self.fqn}"


def _all_meta(module: nn.Module) -> bool:
    return all(t.is_meta for t in (*module.parameters(), *module.buffers()))


def meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose parameters and buffers are meta tensors (allocates nothing)."""
    import copy

    memo: dict[int, Any] = {}
    for t in (*module.parameters(), *module.buffers()):
        meta = torch.empty_like(t, device="meta")
        if isinstance(t, nn.Parameter):
            meta = nn.Parameter(meta, requires_grad=t.requires_grad)
        memo[id(t)] = meta
    return copy.deepcopy(module, memo)
