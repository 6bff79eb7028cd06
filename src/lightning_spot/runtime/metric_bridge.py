"""``self.log(name, metric)`` with a ``torchmetrics.Metric`` object inside a pipelined step, as in plain Lightning.

    calls = MetricCalls(module, last_group, holds_last)  # hooks on every Metric of the module
    with calls.collecting():                             # the last stage's run of the user's step
        module.training_step(micro_batch)                # self.acc(preds, y); self.log("acc", self.acc)
    value = calls.step_value(metric)                     # the metric over the step's micro-batches, all replicas
    shown = SharedMetric(metric, holds_last, share)      # logged on every rank instead of the metric itself

The user's metric lives where its inputs are: on the last stage, updated by the step once per micro-batch,
its state reduced over the last stages of all pipelines (its ``process_group`` is set to them). What plain
Lightning reads from a logged metric is served on every rank by a :class:`SharedMetric`:

* on a step (``on_step=True``): the metric of the step's whole global batch, from the micro-batches' own
  ``metric(...)`` calls replayed into the metric with its epoch's states set aside (exact for any metric, not
  a mean of means);
* on an epoch (``on_epoch=True``): ``compute()`` of the user's metric on the last stages (synced over them),
  sent to the other stages; ``reset()`` resets it. Lightning calls both on every rank, in the same order.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._pytree import tree_map
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_sum

from lightning_spot.partition.discovery import ModelContractError
from lightning_spot.partition.stage_run import active_run
from lightning_spot.replay.metric_states import restore_states


def detached(value: Any) -> Any:
    """``value`` with every tensor in it detached from autograd."""
    return tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, value)


class MetricCalls:
    """The ``metric(...)`` calls of the current step on this rank's last stage, per metric."""

    def __init__(
        self,
        module: nn.Module,
        group: dist.ProcessGroup | None,
        holds_last: bool,
        share: Callable[[Any], Any] | None = None,
    ) -> None:
        self.group = group
        self.calls: dict[int, list[tuple[tuple, dict]]] = {}
        self._collecting = False
        #: the module's metrics (the user's: updated on the last stage)
        self.metrics = [sub for sub in module.modules() if isinstance(sub, Metric)]
        for sub in self.metrics:
            if holds_last:
                sub.process_group = group  # epoch values: reduced over the last stages only
            else:  # never updated here: a compute() of its own must not wait for the last stages
                sub.sync_on_compute = sub._to_sync = False
            sub.register_forward_pre_hook(self._called, with_kwargs=True)
            if share is not None:
                share_computes(sub, holds_last, share)

    def _called(self, metric: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if self._collecting:
            self.calls.setdefault(id(metric), []).append((detached(args), detached(kwargs)))

    def clear(self) -> None:
        self.calls = {}

    @contextlib.contextmanager
    def collecting(self) -> Iterator[None]:
        """Record the metric calls of one run of the user's step (the last stage's, for one micro-batch)."""
        self._collecting = True
        try:
            yield
        finally:
            self._collecting = False

    def step_states(self, metric: Metric) -> tuple[int, dict[str, Tensor]]:
        """(calls, states) of this step's calls on this rank alone: the metric's default states fed with them."""
        calls = self.calls.get(id(metric), [])
        kept = _fresh_states(metric)
        try:
            for args, kwargs in calls:
                metric.update(*args, **kwargs)
            return len(calls), {attr: getattr(metric, attr) for attr in metric._defaults}
        finally:
            restore_states(metric, kept)

    def step_value(self, metric: Metric) -> float | None:
        """The metric over every micro-batch of this step on the last stages of all pipelines (collective over
        them), or ``None`` if the step did not call it (Lightning then logs nothing for the step either)."""
        calls = self.calls.get(id(metric), [])
        called = torch.tensor([float(len(calls))], device=metric.device)
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(called, group=self.group)
        if not called.item():
            return None
        # the metric itself, its epoch's states set aside: fed this step's calls, computed over the last stages
        kept = _fresh_states(metric)
        try:
            for args, kwargs in calls:
                metric.update(*args, **kwargs)
            if not calls:  # a replica without this metric's inputs in this step still takes part in the sync
                metric._update_count = 1
            with computing_locally():
                return float(metric.compute())
        finally:
            restore_states(metric, kept)


#: how many of the bridge's own computations of a metric are under way (they stay on the rank that makes them)
_LOCAL_COMPUTES = [0]


@contextlib.contextmanager
def computing_locally() -> Iterator[None]:
    """``compute()`` of the user's metrics on this rank alone (the bridge's step and epoch values)."""
    _LOCAL_COMPUTES[0] += 1
    try:
        yield
    finally:
        _LOCAL_COMPUTES[0] -= 1


def share_computes(metric: Metric, holds_last: bool, share: Callable[[Any], Any]) -> None:
    """Make the user's ``metric.compute()`` give every rank of the pipeline the last stage's value (synced over the
    last stages of all pipelines), as one process gets it: a hook every rank runs (``on_validation_epoch_end``) may
    compute and log it, where a first stage's own, never updated, metric would give NaN. Like a DDP metric's
    ``compute()``, it is collective: every rank of the pipeline calls it. The step's own calls (inside a stage's run
    of the user's step, as ``metric(preds, y)`` makes) and the bridge's stay local."""
    local = getattr(metric, "_spot_local_compute", None) or metric.compute  # (once per metric: a later run's engine)
    metric._spot_local_compute = local

    def compute(*args: Any, **kwargs: Any) -> Any:
        if active_run() is not None and not _LOCAL_COMPUTES[0]:
            return micro_batch_value(metric, local, args, kwargs)
        if _LOCAL_COMPUTES[0]:
            return local(*args, **kwargs)
        value = detached(local(*args, **kwargs)) if holds_last else None
        value = tree_map(lambda t: t.cpu() if isinstance(t, Tensor) else t, value)
        return tree_map(lambda t: t.to(metric.device) if isinstance(t, Tensor) else t, share(value))

    metric.compute = compute  # type: ignore[method-assign]


#: the metrics whose value of one micro-batch could not be computed (warned about once each)
_UNCOMPUTABLE: set[str] = set()


def micro_batch_value(metric: Metric, local: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
    """What ``metric(preds, target)`` returns inside a stage's run of the step: the value of that call's inputs,
    one micro-batch where one process has the whole batch. A metric that cannot be computed on so few samples
    (``R2Score`` needs two; a short last batch cut into micro-batches of one) gives NaN there instead of failing the
    step, with a warning: what is logged from the metric object is the value of the step's whole batch (or epoch),
    computed by the bridge from every call. Errors of the inputs themselves (raised while the metric takes them in,
    its ``update``: a shape that does not match) are the user's to see, and raised."""
    try:
        return local(*args, **kwargs)
    except (ValueError, RuntimeError) as err:
        if not _raised_computing(err):
            raise
        name = type(metric).__name__
        if name not in _UNCOMPUTABLE:
            _UNCOMPUTABLE.add(name)
            warnings.warn(
                f"spot_pipeline: {name} cannot be computed on one micro-batch ({str(err).splitlines()[0][:160]}): "
                f"calling the metric returns NaN for that micro-batch. A logged metric object "
                f"(`self.log(name, self.metric)`) still shows the value of the whole batch and epoch, as in one "
                f"process; to log the call's own return value, give the step larger micro-batches.",
                UserWarning,
                stacklevel=2,
            )
        return torch.tensor(float("nan"), device=metric.device)


def _raised_computing(err: BaseException) -> bool:
    """Whether ``err`` came from a metric's ``compute`` (the value of too few samples), not from its ``update``."""
    names = []
    frame = err.__traceback__
    while frame is not None:
        names.append(frame.tb_frame.f_code.co_name)
        frame = frame.tb_next
    return "compute" in names and "update" not in names


def refuse_meta_states(module: nn.Module) -> None:
    """A torchmetrics metric built in ``configure_model`` (which runs on the meta device under ``spot_pipeline``)
    holds states without values: refused by name, with the fix, before anything is placed."""
    for name, sub in module.named_modules():
        if isinstance(sub, Metric) and any(
            isinstance(v, Tensor) and v.is_meta for v in (getattr(sub, a, None) for a in sub._defaults)
        ):
            raise ModelContractError(
                f"The torchmetrics metric `{name}` ({type(sub).__name__}) was built in `configure_model`, which "
                f"spot_pipeline runs on the meta device so that each rank materialises only its stages: its states "
                f"hold no values. Create metrics in the LightningModule's `__init__`."
            )


def summed_states(metric: Metric) -> bool:
    """Whether every state of ``metric`` is a tensor that processes combine by summing (counts, sums: most
    metrics), so that its states over several processes are the sums of theirs."""
    return bool(metric._defaults) and all(
        isinstance(default, Tensor) and metric._reductions.get(attr) is dim_zero_sum
        for attr, default in metric._defaults.items()
    )


def value_with(metric: Metric, states: dict[str, Tensor]) -> float:
    """``metric.compute()`` over the given states (its own set aside)."""
    kept = _fresh_states(metric)
    try:
        for attr, value in states.items():
            setattr(metric, attr, value)
        metric._update_count = 1
        with computing_locally():
            return float(metric.compute())
    finally:
        restore_states(metric, kept)


def _fresh_states(metric: Metric) -> dict[str, Any]:
    """Give ``metric`` default states (new objects) and return what it held, untouched, with its counters."""
    kept: dict[str, Any] = {attr: getattr(metric, attr) for attr in metric._defaults}
    kept.update(_update_count=metric._update_count, _computed=metric._computed, _forward_cache=metric._forward_cache)
    for attr, default in metric._defaults.items():
        fresh: Any = default.detach().clone().to(metric.device) if isinstance(default, Tensor) else []
        setattr(metric, attr, fresh)
    metric._update_count, metric._computed = 0, None
    return kept


class SharedMetric(Metric):
    """Stands for a user's metric on every rank: what Lightning reads from a logged ``Metric``.

    ``_forward_cache`` holds the step's value; ``compute()`` is the user's metric computed on the last stages and
    sent to every rank of the pipeline (``share``: the last stage's object on every rank); ``reset()`` resets it.
    """

    full_state_update = False
    metric: Metric
    _forward_cache: Any

    def __init__(self, metric: Metric, holds_last: bool, share: Callable[[Any], Any]) -> None:
        super().__init__(sync_on_compute=False, compute_with_cache=True)
        object.__setattr__(self, "metric", metric)  # not a submodule: no state of ours to save
        self._holds_last = holds_last
        self._share = share
        self._update_count = 1  # Lightning may compute before any update of ours: there is none to make

    def update(self) -> None:  # nothing to accumulate: the user's metric does
        pass

    def compute(self) -> Tensor:
        metric: Metric = self.metric
        value = None
        if self._holds_last:
            with computing_locally():
                computed = metric.compute() if metric.update_called else torch.tensor(float("nan"))
            value = computed.detach().cpu()
        shared = self._share(value)
        return torch.as_tensor(shared, device=self.device)

    def reset(self) -> None:
        super().reset()
        self._update_count = 1
        if self._holds_last:
            self.metric.reset()

    def show_step(self, value: float | None) -> None:
        """The value Lightning logs for this step (``None``: the metric was not called in it)."""
        self._forward_cache = None if value is None else torch.tensor(value, device=self.device)
        self._computed = None
