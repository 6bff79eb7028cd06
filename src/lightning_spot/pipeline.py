"""Build this rank's pipeline stages and run one training / evaluation / prediction step through them.

    engine = PipelineEngine(module, split, plan, spec, ctx)
    loss = engine.train_step(batch, step_args, {})   # whole forward+backward schedule; grads stashed
    engine.restore_grads(scale=1.0)                   # called from the strategy's backward

Each stage is a :class:`StageModule` handed to ``torch.distributed.pipelining``. Its input is the
micro-batch's sample indices (first stage) or the previous stage's activations plus those indices;
its forward replays the user's step function up to the end of the stage's layers (see
``stage_run``). On the last stage, the schedule's ``loss_fn`` replays the whole step function from
the received activation on, so ``self.log`` and the loss come from unchanged user code.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_flatten, tree_map

from lightning_spot.grads import Grads, add_grads, all_reduce_mean, put_grads, take_grads
from lightning_spot.layout import Layout, LayoutError
from lightning_spot.logging_bridge import LogCapture, LogRecord, reduce_records, replay, share_from_last_stage
from lightning_spot.partition.cuts import StagePlan
from lightning_spot.partition.discovery import ModelContractError, ModelSplit
from lightning_spot.partition.placement import PlacedStage, place_stages
from lightning_spot.schedules import ScheduleSpec, resolve_schedule
from lightning_spot.stage_run import StageExit, StageRun, running
from lightning_spot.timeline import StepClock
from lightning_spot.trace_hooks import traced_allreduce_hook, traced_p2p

Mode = Literal["train", "eval", "predict"]


@dataclass
class ParallelContext:
    """Where this rank sits: layout, groups and device."""

    layout: Layout
    pp_rank: int
    dp_rank: int
    pp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    device: torch.device


def batch_size_of(batch: Any) -> int:
    leaves, _ = tree_flatten(batch)
    for leaf in leaves:
        if isinstance(leaf, Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise ModelContractError("spot_pipeline could not find a tensor in the batch to split into micro-batches.")


def _signature(batch: Any) -> tuple:
    leaves, spec = tree_flatten(batch)
    return (str(spec), tuple((tuple(t.shape), t.dtype) for t in leaves if isinstance(t, Tensor)))


def _as_tensors(out: Any, where: str) -> tuple[Tensor, ...]:
    items = out if isinstance(out, (tuple, list)) else (out,)
    if not items or not all(isinstance(t, Tensor) for t in items):
        raise ModelContractError(
            f"{where} returned {type(out).__name__}; layers in the sequence must return a tensor or a tuple of "
            f"tensors so that the output can be sent to the next pipeline stage."
        )
    return tuple(items)


class StepRunner:
    """Runs the user's step function for one stage and one micro-batch (shared by all local stages)."""

    def __init__(self, module: nn.Module, num_stages: int, capture: LogCapture) -> None:
        self.module = module
        self.last_stage = num_stages - 1
        self.capture = capture
        self.fn_name = "training_step"
        self.mode: Mode = "train"
        self.batch: Any = None
        self.local_size = 0
        self.step_args: tuple = ()
        self.step_kwargs: dict[str, Any] = {}
        self.results: list[tuple[Tensor, Any]] = []
        self._inferring = 0
        self._losses_computed = 0
        self.clock = StepClock()

    @contextlib.contextmanager
    def inferring(self) -> Iterator[None]:
        """torch's shape inference runs a throw-away forward: mark it so no user-visible effects happen."""
        self._inferring += 1
        try:
            yield
        finally:
            self._inferring -= 1

    @contextlib.contextmanager
    def bind(self, fn_name: str, mode: Mode, batch: Any, args: tuple, kwargs: dict[str, Any]) -> Iterator[None]:
        self.fn_name, self.mode, self.batch = fn_name, mode, batch
        self.local_size = batch_size_of(batch)
        self.step_args, self.step_kwargs = args, kwargs
        self.results = []
        self._losses_computed = 0
        try:
            yield
        finally:
            self.batch = None

    def _micro_batch(self, idx: Tensor) -> Any:
        size = self.local_size

        def take(t: Any) -> Any:
            if isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == size:
                return t.index_select(0, idx.to(t.device))
            return t

        return tree_map(take, self.batch)

    def _call(self, micro_batch: Any) -> Any:
        if self.mode == "train" and callable(getattr(self.module, "pipeline_loss", None)):
            return self._call_loss_hook(micro_batch)
        return getattr(self.module, self.fn_name)(micro_batch, *self.step_args, **self.step_kwargs)

    def _call_loss_hook(self, micro_batch: Any) -> Any:
        """The module's own loss hook: ``pipeline_loss(self(*pipeline_inputs(batch)), batch)``."""
        module = self.module
        make_inputs = getattr(module, "pipeline_inputs", None)
        if callable(make_inputs):
            inputs = make_inputs(micro_batch)
        elif isinstance(micro_batch, (tuple, list)):
            inputs = micro_batch[:1]
        else:
            inputs = (micro_batch,)
        if not isinstance(inputs, (tuple, list)):
            inputs = (inputs,)
        return module.pipeline_loss(module(*inputs), micro_batch)

    def stage_forward(self, stage: int, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        idx = args[-1]
        acts = args[:-1]
        if self._inferring:
            idx = torch.arange(idx.numel(), device=idx.device)
        if stage == self.last_stage:
            # the last stage's work happens in loss_fn, where the step's result is available
            return tuple(t.view_as(t) for t in (*acts, idx))
        run = StageRun(stage, first_stage=stage == 0, incoming=acts or None, exit_after=True)
        with running(run), self.capture.capturing(self.module, weight=0.0, keep=False):
            try:
                self._call(self._micro_batch(idx))
            except StageExit as stop:
                out = stop.output
            else:
                raise ModelContractError(
                    f"`{self.fn_name}` finished without running the layers of pipeline stage {stage}. The step must "
                    f"call `self(x)` (or the layer sequence) and `forward` must run every layer of the sequence."
                )
        return (*_as_tensors(out, f"the last layer of stage {stage}"), idx.clone())

    def loss_fn(self, output: Any, target: Tensor) -> Tensor:
        outs = output if isinstance(output, tuple) else (output,)
        acts = tuple(outs[:-1])
        idx = target
        if self._inferring:
            # a dense zero gradient: torch derives the backward buffers' strides from it
            parts = [(a.float() * torch.zeros(a.shape, device=a.device)).sum() for a in acts if a.requires_grad]
            return torch.stack(parts).sum() if parts else torch.zeros((), device=idx.device)
        run = StageRun(self.last_stage, first_stage=self.last_stage == 0, incoming=acts or None, exit_after=False)
        microbatch, self._losses_computed = self._losses_computed, self._losses_computed + 1
        # the last stage's layers run here (its forward_one_chunk only passes activations on)
        timed = self.clock.compute("forward", microbatch=microbatch, stage=self.last_stage, part="layers and loss")
        with timed, running(run), self.capture.capturing(self.module, weight=float(idx.numel()), keep=True):
            result = self._call(self._micro_batch(idx))
        if self.last_stage > 0 and not run.layers_started:
            raise ModelContractError(
                f"`{self.fn_name}` on the last pipeline stage never ran the layer sequence; it must compute its "
                f"result from `self(x)`."
            )
        return self._consume(result, idx)

    def _consume(self, result: Any, idx: Tensor) -> Tensor:
        if self.mode == "train":
            loss = result.get("loss") if isinstance(result, Mapping) else result
            if not isinstance(loss, Tensor):
                raise ModelContractError(
                    "training_step must return the loss tensor (or a dict with 'loss') under spot_pipeline; "
                    "skipping a step by returning None cannot be coordinated across pipeline stages."
                )
            if not loss.requires_grad:
                raise ModelContractError("the loss returned by training_step does not depend on the model's output.")
            return loss
        if self.mode == "predict":
            self.results.append((idx, tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, result)))
        return torch.zeros((), device=idx.device)


class StageModule(nn.Module):
    """One pipeline stage as ``torch.distributed.pipelining`` sees it; owns the stage's parameters."""

    def __init__(self, placed: PlacedStage, runner: StepRunner) -> None:
        super().__init__()
        self.stage = placed.stage
        self.owned = nn.ModuleList(placed.modules)
        self.loose = nn.ParameterList(placed.params)
        object.__setattr__(self, "_runner", runner)

    def forward(self, *args: Tensor) -> tuple[Tensor, ...]:
        return self._runner.stage_forward(self.stage, args)


class _SpotStage(PipelineStage):
    """A ``PipelineStage`` that tells the runner when torch runs its shape-inference pass."""

    def __init__(self, *args: Any, runner: StepRunner, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._spot_runner = runner

    def _quiet(self) -> contextlib.AbstractContextManager:
        sync_off = self.submod.no_sync() if isinstance(self.submod, DistributedDataParallel) else contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(self._spot_runner.inferring())
        stack.enter_context(sync_off)
        return stack

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
        with self._quiet():
            return super()._prepare_forward_infra(*args, **kwargs)

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
        with self._quiet():
            return super()._prepare_backward_infra(*args, **kwargs)

    # timed for the bubble figure and, when tracing, the timeline
    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        with self._spot_runner.clock.compute("forward", microbatch=fwd_chunk_id, stage=self.stage_index):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
        with self._spot_runner.clock.compute("backward", microbatch=bwd_chunk_id, stage=self.stage_index,
                                             input_only=not full):
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        with self._spot_runner.clock.compute("weight", microbatch=bwd_chunk_id, stage=self.stage_index):
            return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)


def _no_forward_buffer_sync() -> dict[str, bool]:
    """Replicas keep their own buffers between steps (no broadcast before every micro-batch)."""
    import inspect

    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class PipelineEngine:
    """This rank's stages, their schedules (cached per batch shape) and the step logic."""

    MAX_PROGRAMS = 8

    def __init__(
        self,
        module: nn.Module,
        split: ModelSplit,
        plan: StagePlan,
        spec: ScheduleSpec,
        ctx: ParallelContext,
        *,
        microbatches: int | Literal["auto"] = "auto",
        seed: int = 0,
        ddp_kwargs: dict[str, Any] | None = None,
        activation_checkpointing: bool = False,
    ) -> None:
        self.module = module
        self.plan = plan
        self.spec = spec
        self.ctx = ctx
        self.microbatches = microbatches
        self.capture = LogCapture()
        self.runner = StepRunner(module, plan.num_stages, self.capture)
        self.activation_checkpointing = activation_checkpointing
        placed = place_stages(
            module, split, plan, pp_rank=ctx.pp_rank, device=ctx.device, seed=seed, checkpointing=activation_checkpointing
        )
        self.local_stages = sorted(placed)
        self.stage_modules = {s: StageModule(placed[s], self.runner) for s in self.local_stages}
        self.train_modules: dict[int, nn.Module] = dict(self.stage_modules)
        self.params: list[nn.Parameter] = []
        self.ddp_kwargs = ddp_kwargs or {}
        self.holds_last = plan.num_stages - 1 in placed
        self.last_stage_rank = plan.rank_of_stage(plan.num_stages - 1)
        self._programs: OrderedDict[tuple, Any] = OrderedDict()
        self._pending: Grads | None = None
        self.last_microbatches: int | None = None
        self.last_global_batch: int | None = None
        self.samples_seen = 0
        self.clock = self.runner.clock
        #: this rank's seconds in the last training schedule: wall clock and compute
        self.last_step_seconds = 0.0
        self.last_compute_seconds = 0.0

    def wrap_data_parallel(self, trace_allreduce: bool = False) -> None:
        """Sync gradients across replicas: DDP per stage (overlapped with the last backward), except for
        schedules that compute weight gradients outside autograd's hooks (averaged after the step).

        Call once the parameters have their final dtype and device. ``trace_allreduce`` routes DDP's
        all-reduce through a communication hook that times it for the timeline.
        """
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        if self.ctx.layout.data_parallel == 1 or self.spec.splits_backward:
            return
        for s, m in self.stage_modules.items():
            if any(p.requires_grad for p in m.parameters()):
                self.train_modules[s] = DistributedDataParallel(
                    m,
                    process_group=self.ctx.dp_group,
                    device_ids=[self.ctx.device.index] if self.ctx.device.type == "cuda" else None,
                    **_no_forward_buffer_sync(),
                    **self.ddp_kwargs,
                )
                if trace_allreduce:
                    self.train_modules[s].register_comm_hook(self, traced_allreduce_hook)

    # ----------------------------------------------------------------- schedules
    def _build(self, mode: Mode, n_microbatches: int) -> Any:
        modules = self.train_modules if mode == "train" else self.stage_modules
        stages = [
            _SpotStage(
                modules[s],
                s,
                self.plan.num_stages,
                self.ctx.device,
                group=self.ctx.pp_group,
                runner=self.runner,
            )
            for s in self.local_stages
        ]
        spec = self.spec
        if mode != "train" and not spec.is_multi_stage:
            spec = resolve_schedule("GPipe")  # forward-only: no micro-batch minimum
        try:
            if spec.is_multi_stage:
                return spec.cls(stages, n_microbatches=n_microbatches, loss_fn=self.runner.loss_fn, scale_grads=True)
            return spec.cls(stages[0], n_microbatches=n_microbatches, loss_fn=self.runner.loss_fn, scale_grads=True)
        except ValueError as err:
            raise LayoutError(
                f"schedule {spec.name} with {self.plan.num_stages} stages cannot run {n_microbatches} micro-batches: "
                f"{err} Change `microbatches` (and the batch size, a multiple of data-parallel x microbatches)."
            ) from err

    def _program(self, mode: Mode, fn_name: str, n_microbatches: int, batch: Any) -> Any:
        key = (mode, fn_name, n_microbatches, _signature(batch))
        program = self._programs.get(key)
        if program is None:
            program = self._build(mode, n_microbatches)
            self._programs[key] = program
            while len(self._programs) > self.MAX_PROGRAMS:
                self._programs.popitem(last=False)
        else:
            self._programs.move_to_end(key)
        return program

    # --------------------------------------------------------------- micro-batches
    def train_microbatches(self, local_size: int) -> int:
        """The micro-batch count for a training batch of ``local_size`` samples on this replica."""
        if self.microbatches == "auto":
            target = max(2 * self.ctx.layout.pipeline_stages, self.plan.num_stages)
            fitting = [d for d in _divisors(local_size) if d >= target]
            return fitting[0] if fitting else local_size
        m = int(self.microbatches)
        if local_size % m:
            D = self.ctx.layout.data_parallel
            raise LayoutError(
                f"Each of the {D} data-parallel replicas gets {local_size} samples, which cannot be cut into "
                f"microbatches={m} equal micro-batches. Valid microbatches for this batch: {_divisors(local_size)}; "
                f"or use a global batch that is a multiple of {D * m}."
            )
        return m

    def _eval_candidates(self, local_size: int) -> list[int]:
        cap = self.microbatches if isinstance(self.microbatches, int) else max(2 * self.ctx.layout.pipeline_stages, 1)
        return [d for d in reversed(_divisors(local_size)) if d <= cap] or [1]

    # ----------------------------------------------------------------------- steps
    def train_step(self, batch: Any, args: tuple, kwargs: dict[str, Any]) -> Tensor:
        local = batch_size_of(batch)
        m = self.train_microbatches(local)
        self.last_microbatches = m
        self.last_global_batch = local * self.ctx.layout.data_parallel
        program = self._program("train", "training_step", m, batch)
        saved = take_grads(self.params)
        losses: list[Tensor] = []
        idx = torch.arange(local, device=self.ctx.device)
        self.capture.clear()
        clock = self.clock
        clock.reset()
        start = time.perf_counter()
        tracing = traced_p2p(clock.timeline) if clock.timeline is not None else contextlib.nullcontext()
        with self.runner.bind("training_step", "train", batch, args, kwargs), tracing:
            program.step(idx, target=idx, losses=losses, return_outputs=False)
        self.last_step_seconds, self.last_compute_seconds = time.perf_counter() - start, clock.compute_seconds
        if self.spec.splits_backward and self.ctx.dp_group is not None and self.ctx.layout.data_parallel > 1:
            with clock.span("all-reduce", "allreduce", lane="allreduce"):
                all_reduce_mean(self.params, self.ctx.dp_group)
        self._pending = take_grads(self.params)
        put_grads(self.params, saved)
        self.samples_seen += local * self.ctx.layout.data_parallel
        extra = [LogRecord("__loss__", torch.stack([l.detach().float() for l in losses]).mean(), float(local), {})] if self.holds_last else []
        logged = self._share_logs(extra)
        loss = logged.pop("__loss__")[0]
        replay(self.module, logged, batch_size=local * self.ctx.layout.data_parallel, device=self.ctx.device)
        return torch.tensor(loss, device=self.ctx.device)

    def restore_grads(self, scale: float) -> None:
        """Add the gradients of the last :meth:`train_step` (times ``scale``) to ``.grad``."""
        if self._pending is None:
            raise RuntimeError("spot_pipeline: backward() called without a preceding training step")
        add_grads(self.params, self._pending, scale)
        self._pending = None

    def eval_step(self, fn_name: str, mode: Mode, batch: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        local = batch_size_of(batch)
        idx = torch.arange(local, device=self.ctx.device)
        self.capture.clear()
        error: LayoutError | None = None
        for m in self._eval_candidates(local):
            try:
                program = self._program(mode, fn_name, m, batch)
                break
            except LayoutError as err:
                error = err
        else:
            assert error is not None
            raise error
        with self.runner.bind(fn_name, mode, batch, args, kwargs):
            program.eval(idx, target=idx, return_outputs=False)
            results = sorted(self.runner.results, key=lambda r: int(r[0][0])) if mode == "predict" else []
        extra = [LogRecord("__samples__", torch.tensor(float(local)), 1.0, {"reduce_fx": "sum"})] if self.holds_last else []
        logged = self._share_logs(extra)
        total = int(logged.pop("__samples__")[0])
        replay(self.module, logged, batch_size=total, device=self.ctx.device)
        if mode != "predict":
            return None
        merged = _merge_outputs([r[1] for r in results]) if self.holds_last else None
        return share_from_last_stage(merged, self.ctx.pp_group, self.last_stage_rank)

    def _share_logs(self, extra: list[LogRecord]) -> dict[str, tuple[float, dict[str, Any]]]:
        payload = None
        if self.holds_last:
            payload = reduce_records(self.capture.records + extra, self.ctx.dp_group, self.ctx.device)
        self.capture.clear()
        return share_from_last_stage(payload, self.ctx.pp_group, self.last_stage_rank)


def _merge_outputs(outputs: list[Any]) -> Any:
    """Concatenate per-micro-batch outputs along dim 0 (tensors, or tuples/dicts of tensors)."""
    first = outputs[0]
    if isinstance(first, Tensor) and first.dim() > 0:
        return torch.cat(outputs).cpu()
    if isinstance(first, Mapping):
        return {k: _merge_outputs([o[k] for o in outputs]) for k in first}
    if isinstance(first, (tuple, list)) and first and all(isinstance(t, Tensor) for t in first):
        return type(first)(_merge_outputs([o[i] for o in outputs]) for i in range(len(first)))
    return outputs
