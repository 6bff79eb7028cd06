"""Where the timeline taps into communication: the schedules' point-to-point waits and DDP's
gradient all-reduce. Installed only while tracing (p2p) or when tracing was asked for at setup (DDP).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.pipelining import schedules

from lightning_spot.runtime.clock import StepClock, Timeline


@contextlib.contextmanager
def traced_p2p(timeline: Timeline) -> Iterator[None]:
    """Record every wait for a pipeline send / receive (the time a stage spends blocked on a neighbour)."""
    batch_p2p, wait_batch_p2p = schedules._batch_p2p, schedules._wait_batch_p2p
    kinds: dict[int, str] = {}

    def traced_batch(ops: list[dist.P2POp], desc: str | None = None) -> list[dist.Work]:
        works = batch_p2p(ops, desc)
        kind = "recv" if any(op.op is dist.irecv for op in ops) else "send"
        kinds.update((id(w), kind) for w in works)
        return works

    def traced_wait(works: list[dist.Work]) -> None:
        start = time.perf_counter()
        wait_batch_p2p(works)
        kind = "recv" if any(kinds.pop(id(w), "send") == "recv" for w in works) else "send"
        if works:
            timeline.add(f"wait {kind}", kind, start, time.perf_counter())

    # torch's private p2p helpers, swapped for traced ones while this rank records a timeline
    schedules._batch_p2p, schedules._wait_batch_p2p = traced_batch, traced_wait  # type: ignore[assignment]
    try:
        yield
    finally:
        schedules._batch_p2p, schedules._wait_batch_p2p = batch_p2p, wait_batch_p2p


@dataclass(frozen=True)
class AllreduceTrace:
    """The state of :func:`traced_allreduce_hook`: the data-parallel group and the clock that traces."""

    group: dist.ProcessGroup | None
    clock: StepClock


def traced_allreduce_hook(state: AllreduceTrace, bucket):
    """DDP communication hook: the mean all-reduce of one gradient bucket (``dist.GradBucket``), timed
    when a timeline is attached; returns a ``Future[Tensor]``. (``bucket`` and the result have no
    annotations: DDP checks them against the real classes, which ``from __future__ import annotations``
    turns into strings.)"""
    group = state.group
    size = dist.get_world_size(group)
    timeline = state.clock.timeline
    start = time.perf_counter()
    buffer = bucket.buffer()
    future = dist.all_reduce(buffer, group=group, async_op=True).get_future()

    def finish(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        if timeline is not None:
            timeline.add(
                "all-reduce",
                "allreduce",
                start,
                time.perf_counter(),
                lane="allreduce",
                bucket=bucket.index(),
                bytes=buffer.numel() * buffer.element_size(),
            )
        return done.value()[0].div_(size)

    return future.then(finish)
