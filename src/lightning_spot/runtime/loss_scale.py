"""fp16 mixed precision with one loss scale for every stage and replica (as Megatron-LM, DeepSpeed and Varuna do).

    scaler = coordinated_scaler(strategy.precision_plugin)   # the plugin's GradScaler, agreeing on found-inf
    runner.scaler = scaler                                   # the schedule back-propagates scaler.scale(loss)

Lightning's ``MixedPrecision`` plugin scales the loss in ``backward`` and unscales, steps and updates the scale
around the optimizer step. Under a pipeline the backward runs inside the schedule, on every stage, from the last
stage's loss: that loss is scaled there. Each rank then unscales its own stages' gradients; the scaler is a
``ShardedGradScaler`` over every rank, which all-reduces "found inf", so every rank of every stage and replica
skips the same steps and moves the scale alike. Its state is a few numbers in Lightning's checkpoint, restored
onto any layout.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.amp import GradScaler
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


def coordinated_scaler(plugin: Any) -> GradScaler | None:
    """The precision plugin's gradient scaler (``precision="16-mixed"``), replaced by one with the same settings
    whose found-inf is agreed by every rank; ``None`` without a scaler (other precisions)."""
    scaler = getattr(plugin, "scaler", None)
    if scaler is None or isinstance(scaler, ShardedGradScaler) or not dist.is_initialized():
        return scaler
    agreed = ShardedGradScaler(
        device=scaler._device,
        init_scale=scaler._init_scale,
        backoff_factor=scaler._backoff_factor,
        growth_factor=scaler._growth_factor,
        growth_interval=scaler._growth_interval,
        enabled=scaler.is_enabled(),
        process_group=dist.group.WORLD,
    )
    if scaler.is_enabled() and scaler._scale is not None:  # already used (or restored): keep where it stands
        agreed.load_state_dict(scaler.state_dict())
    plugin.scaler = agreed
    return agreed
