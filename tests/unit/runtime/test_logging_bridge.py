"""Packed logged values: micro-batches and replicas combined in one or two all-reduces (one process)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_spot.runtime.logging_bridge import LogRecord, PackedLogs


class _Replicas:
    """An in-place all-reduce between threads (each thread one replica)."""

    def __init__(self, count: int) -> None:
        self.barrier = threading.Barrier(count, timeout=30)
        self.posted: dict[int, list[torch.Tensor]] = {}
        self.calls: dict[int, int] = {}

    def reducer(self, me: int) -> Any:
        def reduce(tensor: torch.Tensor, op: Any) -> None:
            call = self.calls[me] = self.calls.get(me, 0) + 1
            self.posted.setdefault(call, []).append(tensor.clone())
            self.barrier.wait()
            stacked = torch.stack(self.posted[call])
            combined = {dist.ReduceOp.SUM: stacked.sum(0), dist.ReduceOp.MAX: stacked.max(0).values}[op]
            self.barrier.wait()
            tensor.copy_(combined)

        return reduce


def _records(values: list[float], samples: list[int]) -> list[LogRecord]:
    out = []
    for value, n in zip(values, samples):
        for name, fx in (("mean", "mean"), ("sum", "sum"), ("max", "max"), ("min", "min")):
            out.append(LogRecord(name, torch.tensor(value), float(n), {"reduce_fx": fx}))
    return out


def test_packed_logs_combine_micro_batches_and_replicas_in_two_all_reduces() -> None:
    """Two replicas, two micro-batches each: the mean is weighted by samples, sums add, the largest and smallest
    win, as one process computes over the four micro-batches; two all-reduces (sums, extremes) per replica."""
    replicas, results, errors = _Replicas(2), {}, []
    parts = {0: ([1.0, -3.0], [4, 2]), 1: ([5.0, 2.0], [1, 1])}

    def replica(me: int) -> None:
        try:
            packed = PackedLogs(_records(*parts[me]), torch.device("cpu"))
            assert packed.extremes
            packed.reduce(replicas.reducer(me))
            results[me] = packed.values()
        except Exception as err:  # (reported below, from the test's thread)
            errors.append(err)

    threads = [threading.Thread(target=replica, args=(me,)) for me in parts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    values = [v for vs, _ in parts.values() for v in vs]
    weights = [n for _, ns in parts.values() for n in ns]
    mean = sum(v * n for v, n in zip(values, weights)) / sum(weights)
    for me in parts:
        got = {name: value for name, (value, _) in results[me].items()}
        assert got == pytest.approx({"mean": mean, "sum": sum(values), "max": max(values), "min": min(values)})
        assert replicas.calls[me] == 2


def test_packed_logs_without_max_or_min_take_one_all_reduce() -> None:
    calls = []
    packed = PackedLogs([LogRecord("loss", torch.tensor(2.0), 3.0, {})], torch.device("cpu"))
    packed.reduce(lambda tensor, op: calls.append(op))
    assert not packed.extremes and calls == [dist.ReduceOp.SUM]
    assert packed.values() == {"loss": (2.0, {})}
    empty = PackedLogs([], torch.device("cpu"))
    empty.reduce(lambda tensor, op: calls.append(op))
    assert empty.values() == {} and len(calls) == 1
