"""Build this rank's pipeline stages and run one training / evaluation / prediction step through them.

    engine = PipelineEngine(module, split, layout, ctx)
    loss = engine.train_step(batch, step_args, {})   # whole forward+backward schedule; grads stashed
    engine.restore_grads(scale=1.0)                   # called from the strategy's backward

The stages are :class:`~lightning_spot.runtime.stages.StageModule` s handed to
``torch.distributed.pipelining``; the user's step function runs inside them through a
:class:`~lightning_spot.runtime.step_runner.StepRunner`.
"""

from __future__ import annotations

import contextlib
import functools
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.amp import GradScaler
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_map
from torchmetrics import Metric

from lightning_spot.layout import LayoutError, PipelineLayout
from lightning_spot.partition.cuts import plan_stages
from lightning_spot.partition.discovery import ModelSplit
from lightning_spot.partition.placement import place_stages, placement_of
from lightning_spot.partition.stage_run import Compiler, run_outside_calls
from lightning_spot.replay.metric_states import copied_states, restore_states
from lightning_spot.replay.module_lists import lengths_kept
from lightning_spot.runtime.cross_pipeline import CrossPipelineSync
from lightning_spot.runtime.grads import Grads, add_grads, all_reduce_mean, put_grads, take_grads
from lightning_spot.runtime.held_logs import HELD, HeldLogs
from lightning_spot.runtime.logging_bridge import (
    METRIC,
    LastStageBroadcast,
    LogCapture,
    LogRecord,
    PackedLogs,
    group_reducer,
    reduce_records,
    replay,
)
from lightning_spot.runtime.metric_bridge import MetricCalls, SharedMetric, refuse_meta_states
from lightning_spot.runtime.offload import ActivationOffload
from lightning_spot.runtime.outside_calls import OutsideCalls, next_engine
from lightning_spot.runtime.schedules import measured_bubble, resolve_schedule, theoretical_bubble
from lightning_spot.runtime.stages import SpotStage, StageModule, no_forward_buffer_sync
from lightning_spot.runtime.step_appends import StepAppends
from lightning_spot.runtime.step_runner import (
    SHOULD_STOP,
    STEP_OUTPUTS,
    Mode,
    StepRunner,
    batch_signature,
    batch_size_of,
)
from lightning_spot.runtime.tied import TiedCopies
from lightning_spot.runtime.trace_hooks import AllreduceTrace, traced_allreduce_hook, traced_p2p
from lightning_spot.runtime.weight_streaming import WeightStreaming
from lightning_spot.utils.units import divisors


@dataclass(frozen=True)
class ParallelContext:
    """Where this rank sits: its pipeline and replica position, their process groups, its device."""

    pp_rank: int
    dp_rank: int
    pp_group: dist.ProcessGroup | None
    #: the replicas of this rank's stage (P x D grids); with pipelines of mixed depths, the last stages of all
    #: pipelines on the ranks holding one (logged values are combined over it), else ``None``
    dp_group: dist.ProcessGroup | None
    device: torch.device


class PipelineEngine:
    """This rank's stages, their schedules (cached per batch shape) and the step logic."""

    MAX_PROGRAMS = 8

    def __init__(
        self,
        module: nn.Module,
        split: ModelSplit,
        layout: PipelineLayout,
        ctx: ParallelContext,
        *,
        seed: int = 0,
        ddp_kwargs: dict[str, Any] | None = None,
        activation_checkpointing: bool = False,
        compiler: Compiler | None = None,
        outside_timeout: float = 60.0,
        scaler: GradScaler | None = None,
        activation_offload: ActivationOffload | None = None,
        grads_final: Sequence[Callable[[int], None]] = (),
        optimizer_offload: bool = False,
        replica_group: str | None = None,
    ) -> None:
        """``optimizer_offload``: the optimizers' masters will rest in host memory (:func:`offload_optimizers`);
        ``replica_group``: this pipeline is that torchft replica group (its step's draws get the group in their
        seed, its logged values wait for the commit: ``held_logs``)."""
        self.module = module
        self.layout = layout
        self.split = split
        self.spec = resolve_schedule(layout.schedule, layout.stages // layout.pipeline_stages)
        if layout.is_mixed and self.spec.stages_per_rank != 1:
            raise LayoutError(
                f"pipelines of mixed depths ({layout.grid}) run one stage per rank; schedule {self.spec.name} loops "
                f"over several. Use schedule='1F1B' or 'GPipe', or pipelines of one depth."
            )
        #: the stage plan of every pipeline (one per data-parallel replica; all the same on a P x D grid)
        self.plans = [
            plan_stages(
                split.num_layers,
                depth,
                stages_per_rank=self.spec.stages_per_rank,
                style=self.spec.style,
                cuts=layout.cuts_of(pipeline),
            )
            for pipeline, depth in enumerate(layout.grid.pipeline_depths)
        ]
        self.plan = plan = self.plans[ctx.dp_rank]
        self.ctx = ctx
        self.capture = LogCapture()
        self.runner = StepRunner(module, plan.num_stages, self.capture, ctx.device)
        #: fp16: one loss scale everywhere; activations to host memory; hooks when a stage's gradients are final
        self.runner.scaler, self.runner.activation_offload = scaler, activation_offload
        self.runner.grads_final.extend(grads_final)
        self.runner.draw_seed, self.runner.dp_rank = seed, ctx.dp_rank  # (the step's draws: alike on every stage)
        #: the module's lists that steps append to (Lightning 2's outputs for an epoch's end), kept on every rank
        self.appends = StepAppends(module)
        self.activation_checkpointing = activation_checkpointing
        #: calls of the model outside steps (generate in a hook): run across the pipeline's ranks
        outside_calls, number = None, next_engine()
        if plan.num_stages > 1 and dist.is_initialized():
            outside_calls = OutsideCalls(
                plan, ctx.pp_rank, ctx.dp_rank, ctx.pp_group, ctx.device, outside_timeout, number
            )
        refuse_meta_states(module)  # (a metric built in configure_model: before placement fails on it)
        placed = place_stages(
            module,
            split,
            plan,
            pp_rank=ctx.pp_rank,
            device=ctx.device,
            seed=seed,
            checkpointing=activation_checkpointing,
            compiler=compiler,
            outside=outside_calls,
        )
        self.local_stages = sorted(placed)
        placement = placement_of(module)
        placed_with = placement.outside if placement is not None else None
        if placed_with is outside_calls and outside_calls is not None:  # (placed now, not by an earlier Trainer)
            run_outside_calls()
            if plan.num_stages - 1 in placed:
                for fqn in split.last_modules:
                    outside_calls.watch_last(module.get_submodule(fqn))
        elif placed_with is not None:  # (this Trainer's process groups)
            placed_with.group, placed_with.device = ctx.pp_group, ctx.device
        self.ties = TiedCopies(
            module,
            placement.ties if placement is not None else (),
            split,
            self.plans,
            layout.grid,
            pp_rank=ctx.pp_rank,
            dp_rank=ctx.dp_rank,
        )
        self.cross: CrossPipelineSync | None = None
        self.stage_modules = {s: StageModule(placed[s], self.runner) for s in self.local_stages}
        self.train_modules: dict[int, nn.Module] = dict(self.stage_modules)
        #: the trainable parameters (whose gradients a step keeps for Lightning's backward), followed step by step
        self.params: list[nn.Parameter] = []
        #: those whose gradients are averaged over replicas by what :meth:`wrap_data_parallel` set up (ids), and the
        #: ones made trainable since (a finetuning callback unfreezing a module), averaged after the schedule
        self._synced: set[int] = set()
        self._late: list[nn.Parameter] = []
        #: (the setting, why) parameters may not be made trainable after setup here (``None``: they may)
        self.fixed_params: tuple[str, str] | None = None
        self._torchft = replica_group is not None  # (its reason comes first, then streaming or mixed depths)
        if replica_group is not None:
            self.fixed_params = ("fault_tolerance='torchft'", "its gradient buckets hold the parameters trainable then")
        elif optimizer_offload:
            self.fixed_params = ("offload='optimizer'", "its host masters are the parameters trainable then")
        self.ddp_kwargs = ddp_kwargs or {}
        self.holds_last = plan.num_stages - 1 in placed
        self.holds_first = 0 in placed
        last_stages = ctx.dp_group if self.holds_last else None  # of all pipelines (or None: one pipeline)
        self.runner.loss_weights.use_group(last_stages)
        self.last_stage_rank = plan.rank_of_stage(plan.num_stages - 1)
        self.share = LastStageBroadcast(ctx.pp_group, self.last_stage_rank, ctx.device)
        self.metric_calls = self.runner.metric_calls = MetricCalls(module, last_stages, self.holds_last, self.share)
        #: what stands for each logged torchmetrics.Metric on this rank, by logged name
        self.shared_metrics: dict[str, SharedMetric] = {}
        #: torchft: training steps' logged values wait for the commit (``None``: logged at once); each pipeline is a
        #: replica of its own world (data-parallel rank 0): its step's draws (noise for its rows) get its replica
        #: group in their seed, not another pipeline's
        self.held_logs: HeldLogs | None = None
        if replica_group is not None:
            # (a share of their own to the pipeline's other stages: its names stay known)
            share = LastStageBroadcast(ctx.pp_group, self.last_stage_rank, ctx.device)
            self.held_logs = HeldLogs(module, share, ctx.device, self.holds_last)
            self.runner.dp_rank = zlib.crc32(replica_group.encode())
        self._programs: OrderedDict[tuple, Any] = OrderedDict()
        self._pending: Grads | None = None
        self._pending_factor = 1.0
        #: (the strategy's ``block_backward_sync``, around a batch that Lightning accumulates) the gradients' average
        #: over replicas waits for the accumulation's last batch; ``_deferred``: ``.grad`` holds unaveraged ones
        self.defer_replica_sync = False
        self._deferred = False
        self.last_microbatches: int | None = None
        self.last_global_batch: int | None = None
        self.samples_seen = 0
        self.clock = self.runner.clock
        #: this rank's seconds in the last training schedule: wall clock and compute
        self.last_step_seconds = 0.0
        self.last_compute_seconds = 0.0

    def describe(self) -> str:
        """One line: the layout, schedule, cuts and micro-batches this engine runs."""
        layout, grid, split = self.layout, self.layout.grid, self.split
        checkpointing = ", activation checkpointing" if self.activation_checkpointing else ""
        if grid.is_mixed:
            pipes = ", ".join(
                f"depth {d} cut at {list(layout.cuts_of(i))} with {layout.microbatches_of(i)} micro-batches"
                for i, d in enumerate(grid.pipeline_depths)
            )
            return (
                f"layout {grid} ({grid.data_parallel} pipelines of mixed depths: {pipes}), schedule "
                f"{layout.schedule}, layers of `{split.layers_path}` ({split.num_layers} blocks){checkpointing}"
            )
        return (
            f"layout {grid} ({grid.pipeline_stages} pipeline stages x {grid.data_parallel} data-parallel replicas), "
            f"schedule {layout.schedule}, {layout.stages} stages, layer cuts {list(layout.cuts)} of "
            f"`{split.layers_path}` ({split.num_layers} blocks), {layout.microbatches} micro-batches{checkpointing}"
        )

    def last_step_stats(self) -> dict[str, Any]:
        """Layout and bubble of the last training step on this rank (empty before the first one)."""
        if not self.last_microbatches:
            return {}
        return {
            "layout": str(self.layout.grid),
            "pipeline_layout": str(self.layout),
            "schedule": self.spec.name,
            "microbatches": self.last_microbatches,
            "pipeline_seconds": self.last_step_seconds,
            "compute_seconds": self.last_compute_seconds,
            "bubble": measured_bubble(self.last_step_seconds, self.last_compute_seconds),
            "bubble_theory": theoretical_bubble(
                self.spec.name, self.plan.pp_size, self.spec.stages_per_rank, self.last_microbatches
            ),
        }

    def count_parameters(self) -> int:
        """Parameters of the whole model, over all pipeline stages (collective over the pipeline group)."""
        duplicates = {id(p) for p in self.ties.duplicates}  # a tied weight counts once
        local = sum(p.numel() for p in self.module.parameters() if id(p) not in duplicates)
        return int(self.sum_over_pipeline(torch.tensor([local], dtype=torch.int64)).item())

    def sum_over_pipeline(self, values: Tensor) -> Tensor:
        """``values`` summed over the ranks of this rank's pipeline (collective over the pipeline group), on the host."""
        if self.ctx.pp_group is None:
            return values
        total = values.to(self.ctx.device)
        dist.all_reduce(total, group=self.ctx.pp_group)
        return total.cpu()

    @property
    def microbatches(self) -> int:
        """Micro-batches this rank's pipeline runs per training step."""
        return self.layout.microbatches_of(self.ctx.dp_rank)

    def global_batch_of(self, local: int) -> int:
        """The global batch of a step in which this pipeline trains ``local`` samples."""
        return local * self.layout.total_microbatches // self.microbatches

    def wrap_data_parallel(self, trace_allreduce: bool = False, stream_weights: bool = False) -> None:
        """Sync gradients across replicas: DDP per stage (overlapped with the last backward), except for
        schedules that compute weight gradients outside autograd's hooks (averaged after the step).

        Call once the parameters have their final dtype and device. ``trace_allreduce`` routes DDP's
        all-reduce through a communication hook that times it for the timeline. ``stream_weights``
        (``offload="parameters"``): the weights rest in host memory and come to the device per stage; each
        stage's gradients are averaged when its last backward is done (:class:`WeightStreaming`), not by DDP.
        """
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self._synced = {id(p) for p in self.params}
        self.ties.make_equal()
        if stream_weights:
            if not self._torchft:
                self.fixed_params = ("offload='parameters'", "the weights streamed are the ones trainable at setup")
            if self.layout.is_mixed or self.spec.splits_backward:
                raise LayoutError(
                    f"offload='parameters' runs pipelines of one depth with schedules whose backward computes weight "
                    f"gradients at once; {self.layout.grid} with {self.spec.name} is not supported. Use "
                    f"schedule='LoopedBFS' (Harmony's breadth-first order) on a P x D grid, or offload='optimizer'."
                )
            dp_group = self.ctx.dp_group if self.layout.data_parallel > 1 else None
            seq = self.module.get_submodule(self.split.layers_path)
            layers = {
                s: [seq.get_submodule(self.split.layer_names[i]) for i in self.plan.layers_of(s)]
                for s in self.local_stages
            }
            self.runner.weights = WeightStreaming(layers, self.ctx.device, dp_group, synced=self.stage_modules)
            self.runner.grads_final.insert(0, self.runner.weights.backward_done)  # (before the strategy's hooks)
            return
        if self.layout.is_mixed:
            if not self._torchft:
                self.fixed_params = (
                    "pipelines of mixed depths",
                    "their gradient sums are set up for the parameters then",
                )
            placement = placement_of(self.module)
            self.cross = CrossPipelineSync(
                self.module,
                self.split,
                self.layout.grid,
                self.plans,
                rank=dist.get_rank(),
                ties=placement.ties if placement is not None else (),
            )
            self.cross.make_equal()
            return
        if self.layout.data_parallel == 1 or self.spec.splits_backward:
            return
        for s, m in self.stage_modules.items():
            if any(p.requires_grad for p in m.parameters()):
                ddp = DistributedDataParallel(
                    m,
                    process_group=self.ctx.dp_group,
                    device_ids=[self.ctx.device.index] if self.ctx.device.type == "cuda" else None,
                    **no_forward_buffer_sync(),
                    **self.ddp_kwargs,
                )
                self.train_modules[s] = ddp
                if trace_allreduce:
                    ddp.register_comm_hook(AllreduceTrace(self.ctx.dp_group, self.clock), traced_allreduce_hook)

    # ----------------------------------------------------------------- schedules
    def _build(self, mode: Mode, n_microbatches: int, synced: bool = True) -> Any:
        modules = self.train_modules if mode == "train" and synced else self.stage_modules
        stages = [
            SpotStage(
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
        scale = not self.runner.divides_losses  # (the mean over micro-batches: 0.5 ms of a 24 ms P2xD1 MLP step)
        try:
            first = stages if spec.is_multi_stage else stages[0]
            program = spec.cls(first, n_microbatches=n_microbatches, loss_fn=self.runner.loss_fn, scale_grads=scale)
        except ValueError as err:
            raise LayoutError(
                f"schedule {spec.name} with {self.plan.num_stages} stages cannot run {n_microbatches} micro-batches: "
                f"{err} Change `microbatches` (and the batch size, a multiple of data-parallel x microbatches)."
            ) from err
        # (an instance attribute over torch's method, whose general split with pytree costs ~0.1 ms a step)
        program._split_inputs = functools.partial(self._row_chunks, n_microbatches)
        return program

    def _row_chunks(self, m: int, args: tuple, kwargs: dict[str, Any] | None = None) -> tuple[list[tuple], list[dict]]:
        """A schedule's split of its input into ``m`` micro-batches: the first stage's only input is the local batch's
        row indices (:meth:`_schedule_inputs`), cut as torch cuts them, once per batch size and micro-batch count."""
        if not args:
            return [()] * m, [{}] * m
        (idx,) = args
        return [(rows,) for rows in self.runner.row_chunks(idx.numel(), m)], [{}] * m

    def _schedule_inputs(self, local: int) -> tuple[tuple[Tensor, ...], Tensor | None]:
        """(the schedule's input, its target): the local batch's row indices, for the first and the last stage; a
        rank holding neither passes nothing (rows follow from the micro-batch's index: ``StepRunner._rows``)."""
        idx = torch.arange(local, device=self.ctx.device)
        return ((idx,) if self.holds_first else ()), (idx if self.holds_last else None)

    def _program(self, mode: Mode, fn_name: str, n_microbatches: int, batch: Any, synced: bool = True) -> Any:
        """The schedule for a batch like ``batch`` (cached); ``synced=False``: of the stage modules without DDP (a
        batch that Lightning accumulates: torch's schedules reduce a DDP module's gradients at the last backward)."""
        key = (mode, fn_name, n_microbatches, batch_signature(batch), synced)
        program = self._programs.get(key)
        if program is None:
            program = self._build(mode, n_microbatches, synced)
            self._programs[key] = program
            while len(self._programs) > self.MAX_PROGRAMS:
                self._programs.popitem(last=False)
        else:
            self._programs.move_to_end(key)
        return program

    # --------------------------------------------------------------- micro-batches
    def train_microbatches(self, local_size: int) -> int:
        """The micro-batch count for a training batch of ``local_size`` samples on this replica."""
        m = self.microbatches
        if local_size % m:
            D = self.layout.data_parallel
            raise LayoutError(
                f"Each of the {D} data-parallel replicas gets {local_size} samples, which cannot be cut into "
                f"microbatches={m} equal micro-batches. Valid microbatches for this batch: {divisors(local_size)}; "
                f"or use a global batch that is a multiple of {self.layout.total_microbatches}."
            )
        return m

    def _eval_candidates(self, local_size: int) -> list[int]:
        return [d for d in reversed(divisors(local_size)) if d <= self.microbatches] or [1]

    # ----------------------------------------------------------------------- steps
    def train_step(
        self,
        batch: Any,
        args: tuple,
        kwargs: dict[str, Any],
        global_batch: int | None = None,
        release_grads: bool = False,
    ) -> Tensor | dict[str, Any]:
        """Forward and backward of this replica's ``batch`` (of a global batch of ``global_batch`` samples, by
        default what the layout makes of it); the gradients wait for :meth:`restore_grads`. ``release_grads``: the
        gradients ``.grad`` holds now are not read again (``runtime/zero_grad.py``): dropped before the schedule."""
        local = batch_size_of(batch)
        m = self.train_microbatches(local)
        self._follow_trainable()
        self.appends.before()
        self.last_microbatches = m
        self.last_global_batch = global_batch = global_batch or self.global_batch_of(local)
        defer = self.defer_replica_sync and self._can_defer()  # (a schedule of the stages without DDP then)
        program = self._program("train", "training_step", m, batch, synced=not defer)
        saved = take_grads(self.params)
        if release_grads:
            saved = [None] * len(saved)
        losses: list[Tensor] = []  # what torch back-propagated; the losses to log are in runner.loss_weights
        inputs, target = self._schedule_inputs(local)
        self.capture.clear()
        clock = self.clock
        clock.reset()
        start = time.perf_counter()
        tracing = traced_p2p(clock.timeline) if clock.timeline is not None else contextlib.nullcontext()
        if self.cross is not None:
            self.cross.start_step(m, self.layout.total_microbatches, divided=self.runner.divides_losses)
        self.share.expect()
        # fp16: a micro-batch's scaled loss is divided by the step's micro-batches, so that the backward's fp16
        # values are as large as one process's on the whole batch (the same overflows); multiplied back below
        divisor = self.runner.scale_divisor = self.layout.total_microbatches if self.runner.scaler is not None else 1
        with self.runner.bind("training_step", "train", batch, args, kwargs, m), tracing, self._streaming(("train", m)):
            program.step(*inputs, target=target, losses=losses, return_outputs=False)
        self.last_step_seconds, self.last_compute_seconds = time.perf_counter() - start, clock.compute_seconds
        if self.ctx.dp_group is not None and self.layout.data_parallel > 1 and not defer:
            unsynced = self.params if self.spec.splits_backward else self._late
            if unsynced:
                with clock.span("all-reduce", "allreduce", lane="allreduce"):
                    all_reduce_mean(unsynced, self.ctx.dp_group)
        self.ties.sum_grads(reduce_on=self.ctx.device)
        if self.cross is not None:
            with clock.span("all-reduce", "allreduce", lane="allreduce"):
                self.cross.finish_step()
        self._pending = take_grads(self.params)
        put_grads(self.params, saved)
        if self._deferred and not defer:  # the accumulation's earlier batches, averaged over the replicas at last
            with clock.span("all-reduce", "allreduce", lane="allreduce"):
                all_reduce_mean(self.params, self.ctx.dp_group)  # type: ignore[arg-type]
        self._deferred = defer
        self.samples_seen += global_batch
        weights = self.runner.loss_weights
        logged, outputs = self._share_logs(
            weights.records() if self.holds_last else [], training=True, local=local, m=m
        )
        # losses that are means over items (tokens) count by their items: the gradients get the step's factor
        loss, factor = weights.settle(logged, self.layout.total_microbatches)
        self._pending_factor = factor * divisor
        self.runner.warn_unweighted()
        if self.held_logs is not None:
            self.held_logs.hold(logged, global_batch, self._shown)
        else:
            replay(self.module, logged, batch_size=global_batch, device=self.ctx.device, shown=self._shown)
        step_loss = torch.full((), loss, device=self.ctx.device)  # (a fill: no wait for the device, as a copy would)
        return {"loss": step_loss, **outputs} if outputs else step_loss

    def _follow_trainable(self) -> None:
        """Parameters made trainable since the last step (``BackboneFinetuning`` unfreezing a module, after the
        strategy set up with it frozen): their gradients are kept for Lightning's backward too (which zeroes the
        others), and averaged over replicas after the schedule (DDP knows the parameters trainable at setup only)."""
        trainable = [p for p in self.module.parameters() if p.requires_grad]
        if len(trainable) == len(self.params) and all(a is b for a, b in zip(trainable, self.params)):
            return
        late = [p for p in trainable if id(p) not in self._synced]
        if late and self.fixed_params is not None:
            setting, why = self.fixed_params
            raise LayoutError(
                f"{len(late)} parameter(s) became trainable after spot_pipeline set up (a finetuning callback "
                f"unfreezing a module?), which {setting} ({why}) does not follow. Unfreeze them before fit, or train "
                f"without {setting}: parameters unfrozen during training are followed there."
            )
        self.params, self._late = trainable, late

    def _step_outputs(self, appended: dict | None) -> Any:
        """What the step returned (in training: besides its loss and item count), on every rank of the pipeline: the
        last stage's micro-batches merged (per-sample tensors concatenated, other values listed), as this replica's
        outputs; and what it appended to the module's lists (``appended``, on the last stage), put there."""
        sent = None
        if self.holds_last:
            merged = _merge_outputs(self.runner.step_outputs) if self.runner.step_outputs else None
            sent = tree_map(lambda t: t.cpu() if isinstance(t, Tensor) else t, (merged, appended))
        outputs, appended = tree_map(lambda t: t.to(self.ctx.device) if isinstance(t, Tensor) else t, self.share(sent))
        self.appends.put(appended)
        return outputs

    @contextlib.contextmanager
    def _streaming(self, key: tuple) -> Iterator[None]:
        """Around a schedule: with ``offload="parameters"`` every weight is back in host memory afterwards."""
        weights = self.runner.weights
        if weights is None:
            yield
            return
        weights.begin(key)
        try:
            yield
        finally:
            weights.finish()

    def keep_step(self) -> Callable[[], None]:
        """What a training step changes besides its gradients, taken before it: the returned function puts it back
        (torchft runs a step that did not commit again): the samples counted, the last stage's metric states, the
        logged values held, the entries the step appends to the module's lists."""
        samples = self.samples_seen
        lists = lengths_kept(self.module)
        metrics = [(m, copied_states(m)) for m in self.metric_calls.metrics] if self.holds_last else []
        if self.held_logs is not None:  # (the quorum's step states are added to these once the step commits)
            self.held_logs.before = {id(m): kept for m, kept in metrics}

        def undo() -> None:
            self.samples_seen = samples
            lists()
            for metric, kept in metrics:
                restore_states(metric, kept)
            if self.held_logs is not None:
                self.held_logs.drop()

        return undo

    @contextlib.contextmanager
    def replica_sync_deferred(self) -> Iterator[None]:
        """Around a training step that Lightning accumulates: the replicas average its gradients with the
        accumulation's last batch (see :meth:`_can_defer`)."""
        self.defer_replica_sync = True
        try:
            yield
        finally:
            self.defer_replica_sync = False

    def restore_position(self, samples_seen: int) -> None:
        """The samples trained before the checkpoint this run resumed from (the data's position)."""
        self.samples_seen = samples_seen

    def _can_defer(self) -> bool:
        """Whether the replicas' gradient average can wait for an accumulation's last batch: plain DDP or the
        average after the schedule (not pipelines of mixed depths, streamed weights, or DDP told to find unused
        parameters, where replicas may hold gradients for different parameters)."""
        return (
            self.ctx.dp_group is not None
            and self.layout.data_parallel > 1
            and self.cross is None
            and self.runner.weights is None
            and not self.ddp_kwargs.get("find_unused_parameters", False)
        )

    def restore_grads(self, scale: float) -> None:
        """Add the gradients of the last :meth:`train_step` (times ``scale``) to ``.grad``."""
        if self._pending is None:
            raise RuntimeError("spot_pipeline: backward() called without a preceding training step")
        add_grads(self.params, self._pending, scale * self._pending_factor)
        self._pending = None

    def eval_step(self, fn_name: str, mode: Mode, batch: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        local = batch_size_of(batch)
        inputs, target = self._schedule_inputs(local)
        self.capture.clear()
        self.appends.before()
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
        with self.runner.bind(fn_name, mode, batch, args, kwargs, m), self._streaming((mode, fn_name, m)):
            program.eval(*inputs, target=target, return_outputs=False)
            results = sorted(self.runner.results, key=lambda r: int(r[0][0])) if mode == "predict" else []
        extra = (
            [LogRecord("__samples__", torch.tensor(float(local)), 1.0, {"reduce_fx": "sum"})] if self.holds_last else []
        )
        logged, outputs = self._share_logs(extra, training=False, local=local, m=m)
        total = int(logged.pop("__samples__")[0])
        replay(self.module, logged, batch_size=total, device=self.ctx.device, shown=self._shown)
        if mode != "predict":
            return outputs
        merged = _merge_outputs([r[1] for r in results]) if self.holds_last else None
        return self.share(merged)

    def _share_logs(
        self, extra: list[LogRecord], training: bool, local: int, m: int
    ) -> tuple[dict[str, tuple[Any, dict[str, Any]]], Any]:
        """(the step's logged values, what the step returned besides its loss or ``None``) on every rank of the
        pipeline, from the last stage (whose step ran ``m`` micro-batches of a local batch of ``local`` samples): the
        values say whether outputs, or entries the step appended to the module's lists, follow (:data:`STEP_OUTPUTS`),
        and whether a step set ``trainer.should_stop`` (:data:`SHOULD_STOP`): then it is set on every rank.
        """
        payload = None
        appended = None
        if self.holds_last:
            appended = self.appends.take([len(rows) for rows in self.runner.row_chunks(local, m)])
        if self.runner.step_outputs or appended:  # (the last stage: the step returned or appended something)
            extra = [*extra, LogRecord(STEP_OUTPUTS, torch.ones(()), 1.0, {"reduce_fx": "sum"})]
        trainer = getattr(self.module, "_trainer", None)
        if self.holds_last:
            # (every step, so that the replicas' last stages reduce the same names)
            stop = float(trainer is not None and trainer.should_stop)
            extra = [*extra, LogRecord(SHOULD_STOP, torch.tensor(stop), 1.0, {"reduce_fx": "sum"})]
            records, held = self.capture.records, self.held_logs
            if held is not None and training:  # the user's values: summed over the quorum before the commit
                packed = PackedLogs(records, self.ctx.device)
                reducer = group_reducer(self.ctx.dp_group)
                if reducer is not None:
                    packed.reduce(reducer)
                payload = reduce_records(extra, self.ctx.dp_group, self.ctx.device)
                payload[HELD] = (held.hold_user(packed, self.metric_calls, self._metric_values(training)), {})
            else:
                payload = reduce_records(records + extra, self.ctx.dp_group, self.ctx.device)
                payload.update(self._metric_values(training))
        self.capture.clear()
        self.metric_calls.clear()
        logged = self.share.logged(payload)
        asked = logged.pop(SHOULD_STOP, None)
        if asked is not None and asked[0] and trainer is not None:  # a step asked Lightning to stop: every rank does
            trainer.should_stop = True
        outputs = self._step_outputs(appended) if logged.pop(STEP_OUTPUTS, None) is not None else None
        return logged, outputs

    def _metric_values(self, training: bool) -> dict[str, tuple[Any, dict[str, Any]]]:
        """The step's value of each logged ``torchmetrics.Metric`` (when logged on steps; collective over the last
        stages), with the attribute that holds it."""
        if not self.capture.metrics:
            return {}  # (no walk over the model's modules on every step)
        attributes = {id(m): n for n, m in self.module.named_modules() if isinstance(m, Metric)}
        values = {}
        for name, (metric, options) in sorted(self.capture.metrics.items()):
            on_step = options.get("on_step", training)  # Lightning's defaults: on steps in training only
            value = self.metric_calls.step_value(metric) if on_step else None
            values[name] = (value, {**options, METRIC: attributes[id(metric)]})
        return values

    def _shown(self, name: str, attribute: str, value: Any) -> SharedMetric:
        """The object logged on this rank for the user's metric at ``attribute`` (the same one every step)."""
        shown = self.shared_metrics.get(name)
        if shown is None:
            metric = cast(Metric, self.module.get_submodule(attribute))
            shown = self.shared_metrics[name] = SharedMetric(metric, self.holds_last, self.share).to(self.ctx.device)
        shown.show_step(value)
        return shown


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
