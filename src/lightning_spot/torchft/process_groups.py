"""torchft's process group for the traffic between pipelines, chosen by device: NCCL on CUDA, gloo elsewhere.

    pg = cross_pipeline_group(torch.device("cuda", 0), timedelta(seconds=30))   # ProcessGroupBabyNCCL
    pg = cross_pipeline_group(torch.device("cpu"), timedelta(seconds=30))       # ProcessGroupGloo

On CUDA, gloo would copy every gradient through host memory each step. torchft's ``ProcessGroupBabyNCCL`` runs
its NCCL communicator in a child process, so that a peer lost mid-collective is aborted by ending that child,
never by a hang of the training process (torchft's advice for NCCL). What goes through such a group must live
on the device: gradients do; the small tensors that ride with them (weights, logged sums, speeds) are made there.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch


def cross_pipeline_group(device: torch.device, timeout: timedelta) -> Any:
    """A new, unconfigured torchft process group for tensors on ``device`` (configured per quorum by torchft's
    manager, or by ``mixed_quorum`` for pipelines of other cuts)."""
    if device.type == "cuda":
        from torchft import ProcessGroupBabyNCCL

        return ProcessGroupBabyNCCL(timeout=timeout)
    from torchft import ProcessGroupGloo

    return ProcessGroupGloo(timeout=timeout)
