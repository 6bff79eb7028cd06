"""A training step's ``self.log`` values held until the step counts: what a torchft step logs.

    held = HeldLogs(module, share, device, holds_last)   # engine.held_logs: its train steps replay nothing
    held.before = {...}                                  # the metrics' states before the step (engine.keep_step)
    held.hold_user(packed, calls, metrics)               # (last stage) the user's values and metrics of the step
    held.hold(logged, batch_size, shown)                 # (every rank) the rest of what the step logs
    riders = held.riders()                               # (last stage) summed over the quorum, in place, with the
                                                         # gradients (riders of the last bucket)
    held.park()                                          # (accumulation) this batch's riders are summed: keep it
                                                         # for the window's commit, hold the next batch
    held.replay()                                        # the step committed: logged once, on every rank
    held.drop()                                          # it did not: it logs nothing (it is run again)

A step that a peer's loss interrupts is run again with a new quorum; its values are logged only once, by the run
that commits (epoch means count every step once). Each pipeline logs the whole global batch's values, as one
process would, not those of its own rows: the user's values are summed over the quorum's pipelines, and so are
the step's states of every ``torchmetrics.Metric`` whose states are sums (counts and sums: most metrics); such a
metric's epoch states become those before the step plus the quorum's step states, so its epoch value is the
whole epoch's too. A metric with other states (concatenated, largest...) keeps the pipeline's own rows.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn
from torchmetrics import Metric

from lightning_spot.runtime.logging_bridge import METRIC, LastStageBroadcast, PackedLogs, replay
from lightning_spot.runtime.metric_bridge import MetricCalls, summed_states, value_with

#: in a step's shared values: how many user values wait for the quorum (the other stages then take them too)
HELD = "__held__"

Logged = dict[str, tuple[Any, dict[str, Any]]]


@dataclass
class _StepStates:
    """A metric's states of this step's calls (this pipeline's, then the quorum's)."""

    metric: Metric
    calls: float
    states: dict[str, Tensor]


class HeldLogs:
    """The logged values of the step in flight, replayed through ``LightningModule.log`` once it commits."""

    def __init__(self, module: nn.Module, share: LastStageBroadcast, device: torch.device, holds_last: bool) -> None:
        self.module = module
        #: the last stage's values to the other stages of the pipeline (a share of its own: its names stay known)
        self.share = share
        self.device = device
        self.holds_last = holds_last
        #: each metric's states before the step in flight, by ``id`` (taken by the engine's ``keep_step``)
        self.before: dict[int, dict[str, Any]] = {}
        self._warned = False
        #: (accumulation under torchft) the window's earlier batches, their riders summed, until the commit
        self._parked: list[tuple[Any, ...]] = []
        self.drop()

    def drop(self) -> None:
        """Forget the step in flight and the batches parked before it (it did not commit, or it was logged)."""
        self._parked = []
        self._clear()

    def _clear(self) -> None:
        self.packed: PackedLogs | None = None
        self._metrics: Logged = {}
        self._steps: list[_StepStates] = []
        self._riders: Tensor | None = None
        self._step: tuple[Logged, int, Callable[..., Any]] | None = None

    def hold_user(self, packed: PackedLogs, calls: MetricCalls, metrics: Logged) -> float:
        """(Last stage) the step's user values, and its logged metrics' entries (``metrics``: name -> (this
        pipeline's step value, options)); returns how many values wait for the quorum."""
        self.packed, self._metrics = packed, metrics
        self._steps = []
        for metric in calls.metrics:
            if summed_states(metric):
                count, states = calls.step_states(metric)
                self._steps.append(_StepStates(metric, float(count), states))
            elif not self._warned:
                self._warned = True
                warnings.warn(
                    f"spot_pipeline: the states of {type(metric).__name__} are not all sums: under torchft its "
                    f"values are those of this pipeline's rows of each batch, not of the whole batch",
                    stacklevel=2,
                )
        return float(len(packed.names) + len(metrics))

    def hold(self, logged: Logged, batch_size: int, shown: Callable[..., Any]) -> None:
        """What the step logs besides the user's quorum values (``HELD`` among them), until it commits."""
        self._step = (logged, batch_size, shown)

    def riders(self) -> Tensor | None:
        """(Last stage) the numbers to sum over the quorum with the gradients: the user values' sums and weights,
        each summed metric's calls and step states; summed in place, read at :meth:`replay`."""
        parts = [self.packed.sums.flatten().float().to(self.device)] if self.packed is not None else []
        for step in self._steps:
            parts.append(torch.tensor([step.calls], device=self.device))
            parts += [state.detach().flatten().float().to(self.device) for state in step.states.values()]
        self._riders = torch.cat(parts) if parts and sum(p.numel() for p in parts) else None
        return self._riders

    def park(self) -> None:
        """(Accumulation under torchft) this batch's riders were summed over the quorum on their own: keep the batch
        for the window's commit and hold the next one. Its metrics' quorum states are added at the replay, on top
        of the states the earlier batches of the window left."""
        self._parked.append(self._state())
        self._clear()

    def _state(self) -> tuple[Any, ...]:
        return (self.packed, self._metrics, self._steps, self._riders, self._step)

    def replay(self) -> None:
        """Log the committed step on this rank (with accumulation: each batch of the window, in order): its values,
        and the user's values summed over the quorum (sent from the last stage to the others)."""
        batches = [*self._parked, self._state()]
        for i, (self.packed, self._metrics, self._steps, self._riders, self._step) in enumerate(batches):
            self._replay_one(after_earlier=i > 0)
        self.drop()

    def _replay_one(self, after_earlier: bool) -> None:
        step = self._step
        if step is None:
            return
        logged, batch_size, shown = step
        held = logged.pop(HELD, (0.0, {}))[0]
        if held:
            logged = {**logged, **self.share.logged(self._summed(after_earlier) if self.holds_last else None)}
        module: Any = self.module
        previous = module._current_fx_name
        module._current_fx_name = "training_step"  # (Lightning is inside the optimizer step by now)
        try:
            replay(module, logged, batch_size=batch_size, device=self.device, shown=shown)
        finally:
            module._current_fx_name = previous

    def _summed(self, after_earlier: bool = False) -> Logged:
        """(Last stage) the user's values and metrics over the quorum, from the summed riders; each summed
        metric's epoch states become its states before the step plus the quorum's step states (``after_earlier``: a
        later batch of an accumulation window: the states the window's earlier batches left)."""
        flat, offset = self._riders, 0
        values: Logged = {}
        if self.packed is not None:
            size = self.packed.sums.numel()
            if flat is not None:
                self.packed.sums.copy_(flat[:size].view_as(self.packed.sums))
            values, offset = self.packed.values(), size
        quorum: dict[int, tuple[float, dict[str, Tensor]]] = {}  # each summed metric's calls and step states
        for step in self._steps:
            assert flat is not None
            calls = float(flat[offset])
            offset += 1
            summed = {}
            for attr, state in step.states.items():
                part = flat[offset : offset + state.numel()].view_as(state)
                summed[attr] = (part if state.is_floating_point() else part.round()).to(state.dtype)
                offset += state.numel()
            before = self.before.get(id(step.metric))
            if after_earlier and before is not None:
                before = {attr: getattr(step.metric, attr) for attr in summed}
            if before is not None:
                for attr, value in summed.items():
                    setattr(step.metric, attr, before[attr] + value)
                step.metric._computed = None
            quorum[id(step.metric)] = (calls, summed)
        for name, (local, options) in self._metrics.items():
            metric = cast(Metric, self.module.get_submodule(options[METRIC]))
            if options.get("on_step", True) and id(metric) in quorum:  # (on steps: training's default)
                calls, summed = quorum[id(metric)]
                local = value_with(metric, summed) if calls else None
            values[name] = (local, options)
        return values
