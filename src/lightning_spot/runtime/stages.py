"""One pipeline stage as ``torch.distributed.pipelining`` sees it.

    module = StageModule(placed_stage, runner)        # owns the stage's parameters; forward -> runner
    stage = SpotStage(module, index, num_stages, device, group=pp_group, runner=runner)

:class:`SpotStage` times every forward / backward / weight-gradient chunk on the runner's clock and
marks torch's shape-inference pass, so that it has no user-visible effects.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage
from torch.nn.parallel import DistributedDataParallel

from lightning_spot.partition.placement import PlacedStage
from lightning_spot.runtime.step_runner import StepRunner


class StageModule(nn.Module):
    """One pipeline stage as ``torch.distributed.pipelining`` sees it; owns the stage's parameters."""

    _runner: StepRunner  # kept outside the module tree (not a submodule)

    def __init__(self, placed: PlacedStage, runner: StepRunner) -> None:
        super().__init__()
        self.stage = placed.stage
        self.owned = nn.ModuleList(placed.modules)
        self.loose = nn.ParameterList(placed.params)
        object.__setattr__(self, "_runner", runner)

    def forward(self, *args: Tensor) -> tuple[Tensor, ...]:
        return self._runner.stage_forward(self.stage, args)


class SpotStage(PipelineStage):
    """A ``PipelineStage`` that tells the runner when torch runs its shape-inference pass."""

    def __init__(self, *args: Any, runner: StepRunner, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._spot_runner = runner

    def _quiet(self) -> contextlib.AbstractContextManager:
        sync_off = (
            self.submod.no_sync() if isinstance(self.submod, DistributedDataParallel) else contextlib.nullcontext()
        )
        stack = contextlib.ExitStack()
        stack.enter_context(self._spot_runner.inferring())
        stack.enter_context(sync_off)
        weights = self._spot_runner.weights
        if weights is not None:
            stack.enter_context(weights.resident(self.stage_index))
        return stack

    def _use_weights(self) -> None:
        if self._spot_runner.weights is not None:
            self._spot_runner.weights.use(self.stage_index)

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
        with self._quiet():
            return super()._prepare_forward_infra(*args, **kwargs)

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
        with self._quiet():
            return super()._prepare_backward_infra(*args, **kwargs)

    # timed for the bubble figure and, when tracing, the timeline
    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        self._use_weights()
        saved = self._spot_runner.activation_offload
        if saved is not None:  # what this chunk's forward (and, on the last stage, loss) saves is filed under it
            saved.key = (self.stage_index, fwd_chunk_id)
        self._spot_runner.chunk = fwd_chunk_id  # which rows of the batch the received activations stand for
        with self._spot_runner.clock.compute("forward", microbatch=fwd_chunk_id, stage=self.stage_index):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
        self._use_weights()
        saved = self._spot_runner.activation_offload
        if saved is not None:  # this micro-batch's saved activations come back (and the next one's start to)
            saved.prefetch((self.stage_index, bwd_chunk_id))
        with self._spot_runner.clock.compute(
            "backward", microbatch=bwd_chunk_id, stage=self.stage_index, input_only=not full
        ):
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    # torch's runtime schedules run the backward actions in evaluation too (as no-ops) and still hand their
    # outputs between adjacent stages on one rank (looped schedules on one pipeline rank): nothing to hand over
    def get_local_bwd_output(self, mb_index: int) -> Any:
        return () if not self.has_backward else super().get_local_bwd_output(mb_index)

    def set_local_bwd_input(self, next_stage_bwd_outputs: Any, mb_index: int) -> None:
        if self.has_backward:
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        """torch calls this once the stage's last backward of the step is done (and scales the gradients in it):
        from here on the stage's gradients are final, up to what the engine does after the schedule."""
        super().perform_reduce_grad(grad_scale_factor)
        for listener in self._spot_runner.grads_final:
            listener(self.stage_index)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        with self._spot_runner.clock.compute("weight", microbatch=bwd_chunk_id, stage=self.stage_index):
            return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)


def no_forward_buffer_sync() -> dict[str, Any]:
    """Replicas keep their own buffers between steps (no broadcast before every micro-batch)."""
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}
