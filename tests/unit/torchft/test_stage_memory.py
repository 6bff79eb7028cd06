"""The memory check of a torchft pipeline's stages before it joins: what a stage's training state takes, the
verdict against the device, and the wait of survivors that cannot hold the model (until their agent stops them)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_spot.partition.cuts import StagePlan
from lightning_spot.preemption import PREEMPTED_EXIT_CODE
from lightning_spot.torchft.stage_memory import memory_shortfall, shortfall_message, training_state_bytes
from tests.distributed import REPO


def test_trained_weights_count_with_gradients_and_adam_moments_frozen_ones_once() -> None:
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10, bias=False))  # 110 and 100 fp32 parameters
    model[1].weight.requires_grad_(False)
    assert training_state_bytes(model) == 110 * 4 * 4 + 100 * 4
    # offload="optimizer": the moments (and fp32 masters) live in host memory, the gradients on the device
    assert training_state_bytes(model, ("optimizer",)) == 110 * 4 * 2 + 100 * 4
    assert training_state_bytes(model.to(torch.bfloat16)) == 110 * 2 * 4 + 100 * 2


def test_the_verdict_names_the_rank_the_need_and_the_device() -> None:
    assert shortfall_message([900, 1000], 1000.0, 2, [2]) is None
    why = shortfall_message([900, 20016], 15000.0, 2, [2])
    assert why == (
        "at depth 2 cut at layers [2], rank 1 of this pipeline needs 19.5 KiB for its training state (weights, "
        "gradients, optimizer state; activations on top), more than the 14.6 KiB per device"
    )


def _engine(model: nn.Module) -> SimpleNamespace:
    ctx = SimpleNamespace(pp_group=None, pp_rank=0, device=torch.device("cpu"))
    return SimpleNamespace(module=model, ctx=ctx, plan=StagePlan(bounds=(0, 4), pp_size=1))


def test_one_process_pipeline_checked_against_device_memory() -> None:
    model = nn.Linear(100, 50)  # 5050 parameters: 80.8 kB of training state
    assert memory_shortfall(_engine(model), device_memory=1e6, offloaded=()) is None
    assert "at depth 1, rank 0 of this pipeline needs 78.9 KiB" in (memory_shortfall(_engine(model), 5e4, ()) or "")
    assert memory_shortfall(_engine(model), device_memory=5e4, offloaded=("optimizer",)) is None  # 40.4 kB
    assert memory_shortfall(_engine(model), device_memory=None, offloaded=()) is None  # the host's share: plenty


@pytest.mark.timeout(60)
def test_survivors_that_wait_say_so_and_leave_at_once_when_their_agent_stops_them() -> None:
    code = (
        "from lightning_spot.torchft.stage_memory import wait_for_nodes; "
        "wait_for_nodes('at depth 1, rank 0 needs 2 GiB', 'pipeline 1', first_rank=True)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # (printed before it waits)
        time.sleep(0.5)
        assert proc.poll() is None, "it must wait"
        proc.send_signal(signal.SIGTERM)  # torchrun's agent: a node joined the rendezvous
        assert proc.wait(timeout=10) == PREEMPTED_EXIT_CODE
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert line.startswith("lightning-spot: pipeline 1 waits for its nodes to return: at depth 1, rank 0 needs 2 GiB.")
    assert "the other pipelines train on" in line


def test_a_pipeline_that_does_not_fit_with_no_other_training_fails_with_the_fix() -> None:
    from lightning_spot.layout import LayoutError
    from lightning_spot.torchft import TorchFT
    from lightning_spot.torchft.attach import _check_memory

    settings = TorchFT(lighthouse="http://127.0.0.1:1", replica_group="3")
    with pytest.raises(LayoutError) as err:
        _check_memory(settings, _engine(nn.Linear(100, 50)), 5e4, (), others_train=False)  # type: ignore[arg-type]
    assert str(err.value).startswith("pipeline 3 does not fit its devices: at depth 1, rank 0 of this pipeline needs")
    assert "more nodes or processes" in str(err.value) and "offload='optimizer'" in str(err.value)
    _check_memory(settings, _engine(nn.Linear(100, 50)), 1e6, (), others_train=False)  # type: ignore[arg-type]
