"""Make ``self.log`` in a pipelined step log the true value on every rank, once per step.

The user's step function runs once per micro-batch and reaches its ``self.log`` calls only on the
last stage. :class:`LogCapture` records those calls instead of forwarding them; after the schedule,
:func:`reduce_records` combines them over micro-batches and over the last stage's data-parallel
replicas, :class:`LastStageBroadcast` sends the result to every stage, and :func:`replay` logs it
on each rank through the real ``LightningModule.log``, marked as synchronised already
(``sync_dist_group=ALREADY_REDUCED``: the strategy's ``reduce`` returns such values unchanged).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric

from lightning_spot.utils.distributed import broadcast_object

_SYNC_KEYS = ("sync_dist", "sync_dist_group")
#: the point-to-point tag of a step's logged values (torch.distributed.pipelining sends with the default, 0)
TAG = 0x5107
#: the point-to-point tag of the logged sums the last stages of the pipelines exchange (:func:`exchange_reduce`)
PEER_TAG = 0x5108
#: up to this many replicas (over gloo) exchange their logged sums point to point; more all-reduce them
PEERS_POINT_TO_POINT = 4
#: the ``sync_dist_group`` of values this bridge logs: reduced over micro-batches and replicas already, so the
#: strategy's ``reduce`` hands them back unchanged (and Lightning does not ask for ``sync_dist=True``)
ALREADY_REDUCED = "lightning_spot:already-reduced"
#: in the options of a logged value: the ``LightningModule`` attribute of the ``torchmetrics.Metric`` it stands for
METRIC = "lightning_spot:metric"
_REDUCE = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min"}


@dataclass
class LogRecord:
    name: str
    value: Tensor
    #: of the value among the step's micro-batches: samples, or items for a loss averaged over items
    weight: float | Tensor
    options: dict[str, Any]
    #: ``id`` of the object that was logged (to find the records of a loss)
    source: int = 0
    #: a sum over the micro-batch's samples: a mean's records add up over micro-batches and replicas
    summed: bool = False


@dataclass
class LogCapture:
    """Collects ``self.log`` calls made while a pipeline step runs."""

    records: list[LogRecord] = field(default_factory=list)
    #: ``torchmetrics.Metric`` objects logged in the step, by name, with their options
    metrics: dict[str, tuple[Metric, dict[str, Any]]] = field(default_factory=dict)

    @contextlib.contextmanager
    def capturing(self, module: torch.nn.Module, weight: float, keep: bool) -> Iterator[None]:
        """Route ``module.log`` here; keep the records only when ``keep`` (the last stage)."""

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            if args:
                raise TypeError("spot_pipeline: pass self.log options as keyword arguments")
            if not keep:
                return
            options = {k: v for k, v in kwargs.items() if k not in _SYNC_KEYS}
            if isinstance(value, Metric):  # served on every rank by a SharedMetric (runtime/metric_bridge.py)
                self.metrics[name] = (value, options)
                return
            tensor = value.detach() if isinstance(value, Tensor) else torch.tensor(float(value))
            if tensor.numel() != 1:
                raise ValueError(f"self.log({name!r}, ...) needs a scalar, got shape {tuple(tensor.shape)}")
            self.records.append(LogRecord(name, tensor.reshape(()).float(), weight, options, source=id(value)))

        had = "log" in module.__dict__
        saved = module.__dict__.get("log")
        module.__dict__["log"] = log  # an instance attribute shadows LightningModule.log
        try:
            yield
        finally:
            if had:
                module.__dict__["log"] = saved
            else:
                del module.__dict__["log"]

    def weigh(self, first: int, counts: dict[int, Tensor]) -> None:
        """Records from index ``first`` on whose logged object is a loss with an item count: weigh them by it."""
        if counts:
            for record in self.records[first:]:
                count = counts.get(record.source)
                if count is not None:
                    record.weight = count

    def clear(self) -> None:
        self.records.clear()
        self.metrics.clear()


def _float32s(xs: list[float | Tensor], device: torch.device) -> Tensor:
    """``xs`` as float32 values on ``device`` without the host waiting for it: numbers in one asynchronous copy
    (from pageable memory: staged at once, where a blocking copy synchronises the stream), tensors where they are."""
    if not any(isinstance(x, Tensor) for x in xs):
        return torch.tensor(xs, dtype=torch.float32).to(device, non_blocking=True)
    return torch.stack([torch.as_tensor(x, dtype=torch.float32).to(device, non_blocking=True) for x in xs])


def _reduce_fx(options: dict[str, Any]) -> str:
    fx = options.get("reduce_fx", "mean")
    name = fx if isinstance(fx, str) else getattr(fx, "__name__", "mean")
    return _REDUCE.get(name.lower(), "mean")


#: reduces a tensor in place over some processes with an operation (``dist.all_reduce`` over a group, torchft's)
Reducer = Callable[[Tensor, Any], None]


class PackedLogs:
    """A step's records combined over micro-batches: per name a sum (weighted by samples or items for a mean), its
    weight, its largest and smallest value; reduced over replicas in place, read once.

        packed = PackedLogs(records, device)
        packed.reduce(reducer)          # over replicas (any number of times: data-parallel, then a quorum)
        values = packed.values()        # name -> (value, options)
    """

    def __init__(self, records: list[LogRecord], device: torch.device) -> None:
        by_name: dict[str, list[LogRecord]] = {}
        for r in records:
            by_name.setdefault(r.name, []).append(r)
        self.names = sorted(by_name)
        self.options = [by_name[n][0].options for n in self.names]
        # (Lightning reduces a sum over each batch's samples, logged with its mean, as a mean over batches: the
        # options it gets stay the user's)
        self.fx = [
            "sum" if fx == "mean" and all(r.summed for r in by_name[n]) else fx
            for n, fx in ((n, _reduce_fx(o)) for n, o in zip(self.names, self.options))
        ]
        sums, weights, maxes, mins = [], [], [], []
        for n, fx in zip(self.names, self.fx):
            rs = by_name[n]
            # (no host wait on a GPU: a copy from pageable host memory is staged at once, see _float32s)
            values = torch.stack([r.value for r in rs]).to(device, non_blocking=True)
            w = _float32s([r.weight for r in rs], device)
            # a weight of 0 (a loss over no items: NaN) adds nothing
            sums.append(torch.where(w > 0, values * w, 0.0).sum() if fx == "mean" else values.sum())
            weights.append(w.sum())
            maxes.append(values.max())
            mins.append(values.min())
        empty = torch.zeros(0, device=device)
        #: sums (row 0) and weights (row 1), summed over replicas
        self.sums = torch.stack([torch.stack(sums), torch.stack(weights)]) if self.names else empty.reshape(2, 0)
        self.hi = torch.stack(maxes) if self.names else empty
        self.lo = torch.stack(mins) if self.names else empty

    @property
    def extremes(self) -> bool:
        """Whether a name is reduced by its largest or smallest value (one more all-reduce)."""
        return "max" in self.fx or "min" in self.fx

    def reduce(self, reducer: Reducer) -> None:
        """Combine with the other replicas' records (every replica logged the same names: they run the same code)."""
        if not self.names:
            return
        reducer(self.sums, dist.ReduceOp.SUM)
        self.reduce_extremes(reducer)

    def reduce_extremes(self, reducer: Reducer) -> None:
        """Only the largest and smallest values (the sums went another way: with a pipeline's gradients), in one
        all-reduce: the largest of the values and of their negatives."""
        if self.extremes:
            both = torch.cat([self.hi, -self.lo])
            reducer(both, dist.ReduceOp.MAX)
            self.hi, self.lo = both[: len(self.names)], -both[len(self.names) :]

    def values(self) -> dict[str, tuple[float, dict[str, Any]]]:
        if not self.names:
            return {}
        reduced = {"mean": self.sums[0] / self.sums[1], "sum": self.sums[0], "max": self.hi, "min": self.lo}
        pick = torch.stack([reduced[fx][i] for i, fx in enumerate(self.fx)])
        host = pick.tolist()  # one device-to-host copy per step, whatever the number of logged names
        return {n: (float(host[i]), self.options[i]) for i, n in enumerate(self.names)}


def group_reducer(group: dist.ProcessGroup | None) -> Reducer | None:
    """``dist.all_reduce`` over ``group`` (point to point among a few gloo ranks: :func:`exchange_reduce`); ``None``
    for no group or a group of one."""
    if group is None or dist.get_world_size(group) <= 1:
        return None
    if dist.get_backend(group) == "gloo" and dist.get_world_size(group) <= PEERS_POINT_TO_POINT:
        return lambda tensor, op: exchange_reduce(tensor, op, group)
    return lambda tensor, op: dist.all_reduce(tensor, op=op, group=group)


#: how :func:`exchange_reduce` combines two ranks' values, by the reduction asked for
_COMBINE: dict[Any, Callable[[Tensor, Tensor], Tensor]] = {
    dist.ReduceOp.SUM: torch.add,
    dist.ReduceOp.MAX: torch.maximum,
}


def exchange_reduce(tensor: Tensor, op: Any, group: dist.ProcessGroup) -> None:
    """``dist.all_reduce(tensor, op)`` (a sum or a largest value) of a small host tensor, as messages to and from
    every other rank: gloo runs them on the calling thread, where a collective hands its work to gloo's worker
    threads and wakes them on every rank (an MLP's P2xD2 step took 2.8% less time without that, on two cores).
    Every rank combines the values in the group's rank order: the same result everywhere."""
    combine = _COMBINE.get(op)
    if combine is None or tensor.device.type != "cpu":
        dist.all_reduce(tensor, op=op, group=group)
        return
    rank = dist.get_rank(group)
    theirs = {r: torch.empty_like(tensor) for r in range(dist.get_world_size(group)) if r != rank}
    works: list[Any] = [dist.irecv(buffer, group=group, group_src=r, tag=PEER_TAG) for r, buffer in theirs.items()]
    works += [dist.isend(tensor, group=group, group_dst=r, tag=PEER_TAG) for r in theirs]
    for work in works:
        work.wait()
    parts = [theirs.get(r, tensor) for r in range(len(theirs) + 1)]
    total = parts[0]
    for part in parts[1:]:
        total = combine(total, part)
    tensor.copy_(total)


def reduce_records(
    records: list[LogRecord], dp_group: dist.ProcessGroup | None, device: torch.device
) -> dict[str, tuple[float, dict[str, Any]]]:
    """Combine records over micro-batches (weighted by sample count, or item count) and over ``dp_group``."""
    packed = PackedLogs(records, device)
    reducer = group_reducer(dp_group)
    if reducer is not None:
        packed.reduce(reducer)
    return packed.values()


class LastStageBroadcast:
    """Sends small Python objects from the rank holding the last stage to the other ranks of its pipeline.

        share = LastStageBroadcast(pp_group, last_stage_rank, device)
        obj = share(payload if holds_last_stage else None)        # the last stage's object on every rank
        share.expect()                                            # before a training step's schedule
        logged = share.logged(values if holds_last_stage else None)   # a step's logged values (cheaper)

    A step's values (once their names are known) go point to point from the last stage to each other rank,
    under a tag of their own (:data:`TAG`): gloo runs sends and receives on the calling thread, where a
    collective wakes its worker threads on every rank; and a tag of their own keeps them apart from the
    pipeline's activations and gradients between the same ranks (an earlier point-to-point version used the
    default tag and once received a pipeline tensor). Anything else is a broadcast over the pipeline group.
    """

    def __init__(self, pp_group: dist.ProcessGroup | None, src_group_rank: int, device: torch.device) -> None:
        self.group = pp_group
        self.src = src_group_rank
        self.device = device
        #: the names of the last logged values shared in full, and (whether the value was None, options) of each
        self._known: tuple[tuple[str, ...], tuple[tuple[bool, dict[str, Any]], ...]] | None = None
        #: the last values this rank (the last stage) sent without waiting: the sends and their tensor
        self._sending: tuple[list[Any], Tensor] | None = None
        #: (gloo, a rank that receives) the receive of the next values, posted before the step's schedule
        self._expected: tuple[Any, Tensor] | None = None
        #: this rank in the pipeline group, and the ranks the last stage sends a step's values to
        self._rank = 0
        self._others: list[int] = []
        #: whether this rank receives the values and may post that receive early (gloo; see :meth:`expect`)
        self._receives_early = False
        if pp_group is not None:
            self._rank = dist.get_rank(pp_group)
            self._others = [r for r in range(dist.get_world_size(pp_group)) if r != src_group_rank]
            self._receives_early = self._rank != src_group_rank and dist.get_backend(pp_group) == "gloo"

    def __call__(self, payload: Any) -> Any:
        if self.group is None:
            return payload
        self.flush()
        return broadcast_object(payload, self.group, group_src=self.src)

    def expect(self) -> None:
        """(Before a training step's schedule) post the receive of the step's values on a rank that receives them,
        so that the last stage's send finds it waiting: a receive posted only when they are needed waits for the
        last stage's process to answer it (on two cores, for a time slice: 3.6% of a P2xD1 MLP step). Over gloo
        only: NCCL runs a pair's operations in order, so the pipeline's own sends would queue behind it."""
        if self._receives_early and self._expected is None and self._known is not None:
            self._expected = self._post_receive()

    def _post_receive(self) -> tuple[Any, Tensor]:
        """The receive of the next values of the names every rank knows (the work and its buffer)."""
        assert self._known is not None
        flat = torch.zeros(len(self._known[0]) + 1, dtype=torch.float64, device=self.device)
        return dist.irecv(flat, group=self.group, group_src=self.src, tag=TAG), flat

    def logged(self, payload: dict[str, tuple[Any, dict[str, Any]]] | None) -> dict[str, tuple[Any, dict[str, Any]]]:
        """A step's logged values (name -> (value, options)) from the last stage, on every rank of the pipeline.

        Steps log the same names with the same options step after step: once every rank knows them, only the
        values travel, as one tensor (no pickling, one message per rank); a change of names or options travels whole.
        """
        if self.group is None:
            assert payload is not None
            return payload
        if self._known is not None:
            keys, shape = self._known
            self.flush()
            if self._rank == self.src:
                flat = torch.zeros(len(keys) + 1, dtype=torch.float64)
                if payload is not None and tuple(payload) == keys and _shape_of(payload) == shape:
                    flat[0] = 1.0
                    flat[1:] = torch.tensor(
                        [0.0 if v is None else float(v) for v, _ in payload.values()], dtype=torch.float64
                    )
                received = flat.tolist()
                # the last stage does not wait for the others to take the values (the first stage may still be in
                # the step's last backward): it goes on to its update; the sends are waited for before the next share
                sent = flat.to(self.device, non_blocking=True)  # (staged at once: no wait for the device)
                works = [dist.isend(sent, group=self.group, group_dst=dst, tag=TAG) for dst in self._others]
                self._sending = (works, sent)
            else:
                # posted early (the next values sent, whichever step posted it), or now
                work, flat = self._expected or self._post_receive()
                self._expected = None
                work.wait()
                received = flat.tolist()
            if received[0] == 1.0:  # the values of the names and options every rank knows
                return {k: (None if none else v, o) for k, v, (none, o) in zip(keys, received[1:], shape)}
        payload = broadcast_object(payload, self.group, group_src=self.src)
        self._known = (tuple(payload), _shape_of(payload))
        return payload

    def flush(self) -> None:
        """Wait until the last values this rank sent without waiting have been sent."""
        sending, self._sending = self._sending, None
        if sending is not None:
            for work in sending[0]:
                work.wait()


def _shape_of(payload: dict[str, tuple[Any, dict[str, Any]]]) -> tuple[tuple[bool, dict[str, Any]], ...]:
    """What a payload shares besides its values: for each name, whether its value is ``None``, and its options."""
    return tuple((value is None, options) for value, options in payload.values())


def replay(
    module: Any,
    logged: dict[str, tuple[Any, dict[str, Any]]],
    batch_size: int,
    device: torch.device,
    shown: Callable[[str, str, Any], Metric] | None = None,
) -> None:
    """Log the combined values through the real ``LightningModule.log`` on this rank; a metric (its options name
    it under :data:`METRIC`) as the object ``shown(name, attribute, step value)``."""
    for name, (value, options) in logged.items():
        opts = dict(options)
        attribute = opts.pop(METRIC, None)
        if attribute is not None and shown is not None:
            module.log(name, shown(name, attribute, value), metric_attribute=attribute, **opts)
            continue
        opts.setdefault("batch_size", batch_size)
        synced = not opts.get("rank_zero_only", False)  # Lightning refuses sync_dist with rank_zero_only
        tensor = torch.full((), value, device=device)  # (a fill: torch.tensor(value, device=...) waits for the device)
        module.log(name, tensor, sync_dist=synced, sync_dist_group=ALREADY_REDUCED, **opts)
