"""The strategy's collectives, refused by name inside a pipeline step (where only some ranks run the user's code).

    class SpotPipelineStrategy(..., StepSafeCollectives): ...   # all_gather, barrier, broadcast, reduce

Inside a stage's run of the step a collective would wait for ranks that never call it (the stages of a pipeline
run different parts of the step); outside steps they are Lightning's own. ``reduce`` passes values the logging
bridge already reduced over replicas and micro-batches (``ALREADY_REDUCED``).
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies.parallel import ParallelStrategy
from torch import Tensor
from typing_extensions import override

from lightning_spot.partition.stage_run import refuse_collective_in_step
from lightning_spot.runtime.logging_bridge import ALREADY_REDUCED
from lightning_spot.utils.distributed import broadcast_object, is_initialized


class StepSafeCollectives(ParallelStrategy):
    """Lightning's collectives of a strategy, refused inside a pipeline step (a mixin of ``SpotPipelineStrategy``)."""

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        refuse_collective_in_step("`self.all_gather`")
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        refuse_collective_in_step("The strategy's `barrier`")
        if not is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        refuse_collective_in_step("The strategy's `broadcast`")
        return broadcast_object(obj, group_src=src)

    @override
    def reduce(
        self,
        tensor: Union[Tensor, Any],
        group: Optional[Any] = None,
        reduce_op: Optional[Union[ReduceOp, str]] = "mean",
    ) -> Union[Tensor, Any]:
        if group == ALREADY_REDUCED or not isinstance(tensor, Tensor):
            return tensor  # values the logging bridge reduced over replicas and micro-batches already
        refuse_collective_in_step("The strategy's `reduce`")
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
