"""``SpotPipelineStrategy``: pipeline x data-parallel training for unchanged LightningModules.

    trainer = L.Trainer(accelerator="gpu", devices=8, strategy="spot_pipeline")
    trainer = L.Trainer(strategy=SpotPipelineStrategy(pipeline_stages=4, microbatches=8, schedule="1F1B"))

This class answers Lightning's hooks, each in a few lines; the work happens in the modules beside it
(``settings``: the arguments checked once; ``process``: this process set up; ``assemble``: the pipeline built at
setup; ``loaders``: each rank's share of the data) and in the packages below (``planning``, ``partition``,
``runtime``, ``data``, ``checkpoint``: sharded checkpoints on any layout and their I/O, ``torchft``).
"""

from __future__ import annotations

import weakref
from collections.abc import Generator, Sequence
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from typing_extensions import override

from lightning_spot.checkpoint.callback import checkpoints_last
from lightning_spot.checkpoint.sources import StateSources
from lightning_spot.layout import Layout, PipelineLayout, StagesArg
from lightning_spot.observe import grad_norms
from lightning_spot.planning.choose import LayoutChoice
from lightning_spot.preemption.lightning_sigterm import SigtermAgreement
from lightning_spot.preemption.step_agreement import StepAgreement
from lightning_spot.runtime.callbacks_on_stages import on_stages, writers_once_per_pipeline
from lightning_spot.runtime.clock import StepClock
from lightning_spot.runtime.compiled import CompiledModule
from lightning_spot.runtime.engine import PipelineEngine
from lightning_spot.runtime.offload import OptimizerOffload
from lightning_spot.runtime.process import threads_set_by_user
from lightning_spot.runtime.zero_grad import zeroed_after_step
from lightning_spot.strategy.assemble import build_pipeline, offload_optimizers, route_gradient_clipping
from lightning_spot.strategy.checkpoint_hooks import CheckpointHooks
from lightning_spot.strategy.collectives import StepSafeCollectives
from lightning_spot.strategy.loaders import DataHooks
from lightning_spot.strategy.process import ProcessSetup
from lightning_spot.strategy.process_hooks import ProcessHooks
from lightning_spot.strategy.settings import Microbatches, PartitionArg, PipelineSettings, check_supported
from lightning_spot.torchft import TorchFT
from lightning_spot.torchft.attach import attach
from lightning_spot.torchft.no_replicas import NoReplicas, Replicas
from lightning_spot.watchdog import DEFAULT_STEP_TIMEOUT, DEFAULT_TIMEOUT

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.accelerators import Accelerator
    from torch.distributed.device_mesh import DeviceMesh


class SpotPipelineStrategy(CompiledModule, ProcessHooks, DataHooks, CheckpointHooks, StepSafeCollectives):
    """Split a LightningModule's layer sequence into pipeline stages and replicate the pipeline.

    Args:
        pipeline_stages: pipeline depth P; ``"auto"``: chosen by the planner from a profile of the model
            (without training data: the deepest pipeline that fits). The data-parallel width is D = world size / P.
            A list gives pipelines of mixed depths, one entry per pipeline (``[2, 3]`` on 5 processes): every
            process trains whatever the world size; each pipeline gets its own cuts.
        microbatches: micro-batches per replica and step; ``"auto"``: chosen by the planner (else at least
            2 x P). The DataLoader's ``batch_size`` is the global batch: divisible by D x microbatches.
            With pipelines of mixed depths: the total over all pipelines (split in proportion to each pipeline's
            predicted speed), or a list with each pipeline's count (``[3, 5]``); the global batch is divisible by
            the total.
        schedule: a ``torch.distributed.pipelining`` schedule name, any case: ``GPipe``, ``1F1B``,
            ``Interleaved1F1B``, ``LoopedBFS``, ``InterleavedZeroBubble``, ``ZBVZeroBubble``, ``DualPipeV``;
            ``"auto"``: chosen by the planner (GPipe or 1F1B), else 1F1B.
        stages_per_rank: stages per rank for the looped schedules (default 2).
        partition: where to cut the layer sequence: ``"balanced"`` (profile the layers, minimise the
            slowest stage within the device memory), ``"uniform"`` (even layer counts), explicit cut
            indices (the first layer of each stage but the first), or ``"auto"`` (balanced when the
            layout is planned, else uniform).
        activation_checkpointing: recompute each layer's activations in backward; ``None``: the
            planner decides (off without a plan).
        device_memory: memory per device for planning (``"80GB"``); default: what the device reports.
        profile_cache: directory for layer profiles (reused when model, input and device match); ``None``: off.
        layers: dotted attribute path of the layer sequence (``nn.Sequential`` / ``nn.ModuleList``), e.g.
            ``"model.transformer.h"``; ``"auto"``: the sequence of same-type blocks holding the most parameters.
        first_stage_modules / last_stage_modules: override where modules beside the sequence go.
        find_unused_parameters: passed to DDP for the data-parallel gradient sync.
        offload: keep training state in host memory: ``"optimizer"`` (fp32 master weights and the optimizer's
            state live in host memory; the update runs there and the new weights are copied back),
            ``"parameters"`` (also the weights: each stage's come to the device only while it computes, the next
            stage's prefetched; with ``schedule="LoopedBFS"``, the default then, and one layer per stage, the
            default ``stages_per_rank`` then, once per forward and once per backward of a step; implies
            ``"optimizer"``), ``"activations"`` (what the forward saves for the backward goes to host
            memory and comes back when needed), several as a list, or ``"auto"``: the planner keeps state on the
            device when it fits and offloads the least that makes it fit otherwise. ``None``: off.
        pretrained: a ``save_pretrained`` directory (safetensors, sharded or not) to start from: after the model
            is split, each rank reads only its stages' tensors (build the model on the meta device in
            ``configure_model`` so that no rank ever holds all of it). A checkpoint being resumed wins.
        process_group_backend: ``"nccl"`` / ``"gloo"``; default by device.
        timeout: collective timeout: the longest any rank waits for the others at setup, in saves and at epoch
            boundaries (default 10 minutes: above per-rank pretrained reads and blocking saves of large stages).
        step_timeout: seconds a pipeline step may run before a rank gives up on its peers (a frozen or vanished
            node: gloo's point-to-point receives never time out); five times the median of the recent steps when
            that is longer, ``timeout`` for the first step of each kind; ``None``: off. One rank's error stops
            every rank within seconds regardless (``lightning_spot.watchdog``).
        fault_tolerance: ``"torchft"`` (or :class:`~lightning_spot.torchft.TorchFT`): this process group is
            one pipeline of a job of several, joined by a torchft lighthouse; when one is lost the others go on
            training without a restart, and a returning one takes a live peer's state (docs/launch-and-preemption.md).
    """

    strategy_name = "spot_pipeline"

    def __init__(
        self,
        pipeline_stages: StagesArg = "auto",
        microbatches: Microbatches = "auto",
        schedule: str = "auto",
        stages_per_rank: Optional[int] = None,
        partition: PartitionArg = "auto",
        activation_checkpointing: Optional[bool] = None,
        device_memory: Union[int, float, str, None] = None,
        profile_cache: Optional[str] = "~/.cache/lightning_spot/profiles",
        layers: str = "auto",
        first_stage_modules: Sequence[str] = (),
        last_stage_modules: Sequence[str] = (),
        find_unused_parameters: bool = False,
        pretrained: Optional[str] = None,
        offload: Union[str, list[str], None] = None,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = DEFAULT_TIMEOUT,
        step_timeout: Optional[float] = DEFAULT_STEP_TIMEOUT,
        fault_tolerance: Union[str, TorchFT, None] = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.settings = PipelineSettings.from_args(
            pipeline_stages=pipeline_stages, microbatches=microbatches, schedule=schedule,
            stages_per_rank=stages_per_rank, partition=partition, activation_checkpointing=activation_checkpointing,
            device_memory=device_memory, profile_cache=profile_cache, layers=layers,
            first_stage_modules=first_stage_modules, last_stage_modules=last_stage_modules,
            find_unused_parameters=find_unused_parameters, pretrained=pretrained, offload=offload, timeout=timeout,
            step_timeout=step_timeout, fault_tolerance=fault_tolerance,
        )  # fmt: skip
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        self._user_threads = threads_set_by_user()
        self.process: Optional[ProcessSetup] = None
        self.engine: Optional[PipelineEngine] = None
        self.layout_choice: Optional[LayoutChoice] = None
        self._device_mesh: Optional[DeviceMesh] = None
        #: host masters and optimizer state when ``offload="optimizer"`` (set up with the optimizers)
        self.offload: Optional[OptimizerOffload] = None
        #: this pipeline's torchft replica group, or the null object that passes every call through
        self._replicas: Replicas = NoReplicas()
        #: what the last training batch's gradients are multiplied by as they enter ``.grad`` (``Replicas.batch_done``)
        self._batch_factor = 1.0
        self._sigterm: Optional[SigtermAgreement] = None
        #: the one per-step agreement of this process (Lightning's SIGTERM stop and SpotCheckpoint contribute)
        self.step_agreement = StepAgreement()
        #: the stream loaders made for Lightning (it cannot shut their DataLoaders' workers down itself)
        self._streams: weakref.WeakSet[Any] = weakref.WeakSet()
        #: names of the pretrained tensors this rank read (empty without ``pretrained``)
        self.pretrained_reads: list[str] = []
        #: time DDP's gradient all-reduce in timelines (set by ``PipelineTimeline`` before setup)
        self.trace_allreduce = False
        self.restored_manifest: Optional[dict[str, Any]] = None
        self.sources = StateSources()  # storage options, run directory, snapshots: where resumes read from

    # ------------------------------------------------------------------ registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls, description="Pipeline x data parallelism for preemptible GPUs (lightning-spot)"
            )

    # ---------------------------------------------------------------- properties
    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def pipeline_layout(self) -> PipelineLayout:
        """The whole layout of this run: P x D, schedule, stages, cuts and micro-batches."""
        if self.layout_choice is None:
            raise RuntimeError("The pipeline layout is known once the strategy has been set up.")
        return self.layout_choice.layout

    @property
    def layout(self) -> Layout:
        """The process grid of this run (P x D; ``str`` gives "P2xD2")."""
        return self.pipeline_layout.grid

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError("The device mesh exists once processes have initialised.")
        return self._device_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if self.layout_choice is None:  # (setup samples a batch before the layout exists: one replica, all the data)
            return {"num_replicas": 1, "rank": 0}
        return {"num_replicas": self.layout.data_parallel, "rank": self.layout.dp_rank(self.global_rank)}

    # -------------------------------------------------------------------- setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        check_supported(module, self.precision_plugin, self.settings)
        if self.engine is None:
            built = build_pipeline(
                module, self.settings, self.sources, precision=self.precision_plugin, device=self.root_device,
                rank=self.global_rank, world_size=self.world_size, compiler=self._compiler,
                trace_allreduce=self.trace_allreduce, grads_final=self._stage_grads_final,
            )  # fmt: skip
            self.engine, self.layout_choice, self._device_mesh = built.engine, built.choice, built.mesh
            self.pretrained_reads = built.pretrained_reads
        trainer._accelerator_connector.use_distributed_sampler = False  # (ours keeps the user's order)
        self.model = module
        fitting = trainer.state.fn == TrainerFn.FITTING
        streamed = "parameters" in self._offloaded()
        if fitting:  # (weights streamed from host memory: averages rest there too)
            on_stages(trainer, module, self.engine, streamed=streamed)
            checkpoints_last(trainer)
            self.setup_optimizers(trainer)
        writers_once_per_pipeline(trainer, self.engine.ctx.pp_rank)
        self.setup_precision_plugin()
        route_gradient_clipping(self.engine, self.precision_plugin, self.root_device)
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
            if "optimizer" in self._offloaded():
                self.offload = offload_optimizers(self.engine, list(self.optimizers))
            ft = self.settings.fault_tolerance
            if ft is not None and self.replicas is None:
                self._replicas = attach(
                    trainer,
                    self.engine,
                    ft,
                    group_size=self.world_size,
                    offloaded=self._offloaded(),
                    offload=self.offload,
                    device_memory=self.settings.requested.device_memory,
                )

    def _stage_grads_final(self, stage: int) -> None:
        """A stage's backward of the step is over: with the optimizer offloaded, its gradients start for the host
        (not under torchft: the gradients that reach the host are the quorum's mean, after the step)."""
        if self.offload is not None and self.replicas is None:
            self.offload.copy_out(self._engine().stage_modules[stage].parameters())

    def _offloaded(self) -> tuple[str, ...]:
        """The offload levels of this run: as asked, or as the planner chose for ``offload="auto"``."""
        return self.layout_choice.offload if self.layout_choice is not None else ()

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if self.engine is not None and self.engine.runner.weights is not None:
            return  # offload="parameters": the weights rest in host memory and come to the device per stage
        self.model.to(self.root_device)

    # -------------------------------------------------------------------- steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.train_step_context(), self._watched("training_step"):
            engine, module = self._engine(), self.lightning_module
            # (under torchft: this pipeline's rows of the global batch, among those in the quorum; ``again`` runs
            # this batch again should its accumulation window not commit)
            step = module.global_step if module else 0
            again = partial(self._train_again, args, kwargs)
            batch, size = self._replicas.begin_step(args[0], engine.microbatches, step, again)
            release = module is not None and zeroed_after_step(module.trainer, module)
            output = engine.train_step(batch, args[1:], kwargs, global_batch=size, release_grads=release)
            # (torchft, accumulating: this batch's part of the quorum's mean, once its weights are summed)
            self._batch_factor = self._replicas.batch_done(engine.runner.loss_weights.items)
            return output

    def _train_again(self, args: tuple, kwargs: dict[str, Any]) -> None:
        """(torchft) a batch of an accumulation window that did not commit, run again with the next quorum: its
        step and its gradients into ``.grad``, as Lightning's closure did (its hooks are not called again)."""
        self.training_step(*args, **kwargs)
        module = self.lightning_module
        assert module is not None
        self._engine().restore_grads(scale=self._batch_factor / module.trainer.accumulate_grad_batches)

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """(Lightning, around a batch it accumulates) the replicas average the gradients at the last batch only."""
        with self._engine().replica_sync_deferred():
            yield

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        engine = self._engine()
        with ExitStack() as stack:
            # (torchft: gradients averaged over the quorum; the update only when the step commits)
            closure = self._replicas.committed(closure, lambda: engine.runner.loss_weights.items, engine.keep_step)
            if self.offload is not None:  # the update (and clipping) run on the host, on the quorum's gradients
                closure = stack.enter_context(self.offload.updating(optimizer, closure))
            clock = engine.clock
            if clock is not None and clock.timeline is not None:  # the closure runs the schedule: time the update
                closure = _then_timed(closure, lambda: stack.enter_context(clock.span("optimizer", "optimizer")))
            result = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.step_agreement.settle()  # every rank posted it at the step's start
        return result

    @property
    def step_clock(self) -> Optional[StepClock]:
        """This rank's pipeline clock (compute time per step; attach a ``Timeline`` to trace)."""
        return self.engine.clock if self.engine is not None else None

    def pipeline_stats(self) -> dict[str, Any]:
        """Layout and bubble of the last training step on this rank (empty before the first one)."""
        return self.engine.last_step_stats() if self.engine is not None else {}

    def count_parameters(self) -> int:
        """Parameters of the whole model, over all pipeline stages (collective over the pipeline group)."""
        return self._engine().count_parameters()

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Put the gradients computed by the schedule in place (Lightning cleared them after the step)."""
        module = self.lightning_module
        assert module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        accumulate = module.trainer.accumulate_grad_batches if module._trainer is not None else 1
        self._engine().restore_grads(scale=self._batch_factor / accumulate)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context(), self._watched("validation_step"):
            return self._engine().eval_step("validation_step", "eval", args[0], args[1:], kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context(), self._watched("test_step"):
            return self._engine().eval_step("test_step", "eval", args[0], args[1:], kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context(), self._watched("predict_step"):
            return self._engine().eval_step("predict_step", "predict", args[0], args[1:], kwargs)

    @override
    def teardown(self) -> None:
        grad_norms.use_scope(None)
        if self._sigterm is not None:
            self._sigterm.uninstall()
            self._sigterm = None
        if self.process is not None:
            self.process.stop()
        self._replicas.shutdown()
        self._replicas = NoReplicas()
        for stream in list(self._streams):
            stream.close()
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()


def _then_timed(closure: Any, start_span: Any) -> Any:
    """``closure`` (the step's schedule), then a span opened for what follows it (the update)."""

    def timed() -> Any:
        result = closure()
        start_span()
        return result

    return timed
