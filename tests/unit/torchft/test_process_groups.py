"""The traffic between pipelines goes over NCCL on CUDA (torchft's ProcessGroupBabyNCCL) and gloo on CPU: the
choice, and a replica group on a CUDA device that hands its manager, its buckets and what it sends that device.
(The GPU check script runs it: benchmarks/gpu_checks.sh, ft_nccl.)"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import nn

from lightning_spot.runtime.loss_weights import LossWeights
from lightning_spot.torchft import TorchFT
from lightning_spot.torchft.process_groups import cross_pipeline_group
from lightning_spot.torchft.replica_group import ReplicaGroup
from tests.unit.torchft.conftest import FakeManager


def test_nccl_on_cuda_gloo_elsewhere() -> None:
    from torchft import ProcessGroupBabyNCCL, ProcessGroupGloo

    timeout = timedelta(seconds=5)
    assert isinstance(cross_pipeline_group(torch.device("cuda", 0), timeout), ProcessGroupBabyNCCL)
    assert isinstance(cross_pipeline_group(torch.device("cpu"), timeout), ProcessGroupGloo)


def test_a_replica_group_on_a_gpu_sends_from_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import torchft
    from torchft import ProcessGroupBabyNCCL

    handed: dict[str, Any] = {}

    class Manager(FakeManager):
        def __init__(self, pg: Any, **kwargs: Any) -> None:
            handed["pg"] = pg
            super().__init__(**kwargs)

    monkeypatch.setattr(torchft, "Manager", Manager)
    settings = TorchFT(lighthouse="http://127.0.0.1:1", replica_group="1")
    device = torch.device("cuda", 0)
    group = ReplicaGroup(settings, group_rank=1, group_size=2, state_dict=dict, layout="s2c2", device=device)
    try:
        assert isinstance(handed["pg"]._inner, ProcessGroupBabyNCCL)  # (torchft's group per stage of the quorum)
        group.overlap([nn.Parameter(torch.zeros(2))], [], LossWeights())
        assert group.buckets is not None and group.buckets.device == device  # (a stage without parameters' tail)
        assert group.device == device
    finally:
        group.shutdown()
