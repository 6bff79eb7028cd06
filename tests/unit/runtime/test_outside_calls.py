"""Calls of a model split into stages outside steps (``runtime/outside_calls.py``): when they go across the pipeline,
and the error when some ranks of the pipeline make one and others do not.

That every rank gets one process's tokens from ``generate`` (in a hook and after fit) is a parity test in
``tests/integration/test_hf_models.py``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from lightning_spot import ModelContractError, plan_stages
from lightning_spot.partition import stage_run
from lightning_spot.runtime.outside_calls import OutsideCalls


@pytest.fixture
def one_process_group() -> Iterator[None]:
    """A gloo group of this process alone (a pipeline of two stages whose other rank never comes)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_call_that_the_other_ranks_of_the_pipeline_do_not_make_is_named(one_process_group: None) -> None:
    calls = OutsideCalls(plan_stages(4, 2), pp_rank=0, dp_rank=0, group=None, device=torch.device("cpu"), timeout=0.5)
    start = time.monotonic()
    with pytest.raises(ModelContractError, match=r"pipeline rank\(s\) \[1\] did not within 0.5 s.*global_rank == 0"):
        calls._meet("model.layers.0")
    assert time.monotonic() - start < 5


def test_calls_go_across_the_pipeline_only_outside_steps_shape_reads_and_backwards(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(stage_run, "_OUTSIDE_CALLS", True)
    assert stage_run.outside_call()
    with stage_run.shapes_only():
        assert not stage_run.outside_call()
    run = stage_run.StageRun(stage=0, first_stage=True, incoming=None, exit_after=True)
    with stage_run.running(run):
        assert not stage_run.outside_call()
    seen = []

    class Recompute(torch.autograd.Function):  # (a checkpoint recomputes a step's calls in the backward)
        @staticmethod
        def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
            seen.append(stage_run.outside_call())
            return grad * 2

    Recompute.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert seen == [False]
    monkeypatch.setattr(stage_run, "_OUTSIDE_CALLS", False)
    assert not stage_run.outside_call()  # (not a pipeline: a model on one stage is called as it is)
