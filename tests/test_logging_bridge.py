"""A step's logged values combined over micro-batches and replicas (``PackedLogs``), without processes."""

from __future__ import annotations

import json
import threading
from pathlib import Path
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


def test_a_receive_posted_before_the_step_gets_the_step_s_values_and_leaves_the_pipeline_s_sends_alone(
    tmp_path: Path,
) -> None:
    """The first stage posts the receive of a step's logged values before the step's schedule (the last stage's
    send then finds it waiting); the pipeline's point-to-point tensors between the same ranks pass meanwhile, and
    every step's values arrive in order, through a change of names and an evaluation step that posts nothing."""
    from tests.distributed import launch
    from tests.workers.share_values import STEPS

    launch(2, ["tests/workers/share_values.py", str(tmp_path)], log_dir=tmp_path / "logs", timeout=120)
    expected = [{name: step + i / 10 for i, name in enumerate(names)} for step, (_, names) in enumerate(STEPS)]
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == expected  # (float64 all the way)


def test_the_last_stages_exchange_logged_sums_point_to_point_with_an_all_reduce_s_result(tmp_path: Path) -> None:
    """Three gloo ranks reduce with ``group_reducer`` (messages on the calling thread, not a collective): sums equal
    ``dist.all_reduce``'s and are the same bits on every rank (values of very different sizes, where the order of
    the additions shows), largest values are exact, a smallest value falls back to the all-reduce; a pipeline's
    tensors in flight between the same ranks under the default tag stay apart."""
    from tests.distributed import launch
    from tests.workers.exchange_reduce import STEPS

    launch(3, ["tests/workers/exchange_reduce.py", str(tmp_path)], log_dir=tmp_path / "logs", timeout=120)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(3)]
    assert len(ranks[0]) == STEPS
    for step in range(STEPS):
        got = [rank[step] for rank in ranks]
        for one in got:
            assert one["sums"] == pytest.approx(one["expected_sums"], rel=1e-6)
            assert one["highs"] == one["expected_highs"]
            assert one["lows"] == one["expected_lows"]
        assert got[0]["sums"] == got[1]["sums"] == got[2]["sums"]
