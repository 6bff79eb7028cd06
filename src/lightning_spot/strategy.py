"""``SpotPipelineStrategy``: pipeline x data-parallel training for unchanged LightningModules.

    trainer = L.Trainer(accelerator="gpu", devices=8, strategy="spot_pipeline")
    trainer = L.Trainer(strategy=SpotPipelineStrategy(pipeline_stages=4, microbatches=8, schedule="1F1B"))

This class is Lightning glue only; the work happens in ``planning`` (the layout, chosen once at
setup), ``partition`` (layer discovery, cuts, placement), ``runtime`` (stages, schedules, steps,
gradients, logging), ``data`` (global-batch sharding) and ``checkpoint`` (sharded state).
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Generator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning.pytorch.utilities.types import STEP_OUTPUT
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_spot.checkpoint import flat_optimizer, payload
from lightning_spot.checkpoint.callback import checkpoints_last
from lightning_spot.checkpoint.durable import pretrained_record, write
from lightning_spot.checkpoint.durable.storage import Storage
from lightning_spot.checkpoint.memory.snapshot import SnapshotStore
from lightning_spot.checkpoint.sources import StateSources
from lightning_spot.data.sharded import shard_dataloader
from lightning_spot.data.streams import is_stream, stage_feed, stream_dataloader
from lightning_spot.layout import Layout, LayoutError, PipelineLayout, StagesArg
from lightning_spot.observe import grad_norms
from lightning_spot.partition.discovery import ModelContractError, ModelSplit, discover
from lightning_spot.partition.placement import placement_of
from lightning_spot.partition.pretrained import SafetensorsWeights, load_stage_weights
from lightning_spot.partition.run_order import place_by_run
from lightning_spot.partition.stage_run import refuse_collective_in_step
from lightning_spot.planning.choose import (
    LayoutChoice,
    Requested,
    choose_layout,
    describe_choice,
    first_samples,
    shared_sample_batch,
)
from lightning_spot.planning.memory import PlanPlace
from lightning_spot.preemption.lightning_sigterm import SigtermAgreement
from lightning_spot.runtime.callbacks_on_stages import on_stages, writers_once_per_pipeline
from lightning_spot.runtime.clock import StepClock
from lightning_spot.runtime.compiled import CompiledModule
from lightning_spot.runtime.cross_pipeline import mixed_groups
from lightning_spot.runtime.engine import ParallelContext, PipelineEngine
from lightning_spot.runtime.grads import global_norm_clipping, norm_scope
from lightning_spot.runtime.host_malloc import MallocSetup, keep_freed_host_memory
from lightning_spot.runtime.logging_bridge import ALREADY_REDUCED
from lightning_spot.runtime.loss_scale import coordinated_scaler
from lightning_spot.runtime.offload import ActivationOffload, OptimizerOffload, offload_levels
from lightning_spot.runtime.process import (
    ThreadSetup,
    destroy_process_group_at_exit,
    elastic_world,
    set_up_threads,
    threads_set_by_user,
)
from lightning_spot.runtime.schedules import resolve_schedule
from lightning_spot.runtime.zero_grad import zeroed_after_step
from lightning_spot.torchft import TorchFT, resolve_fault_tolerance
from lightning_spot.torchft.attach import HEAL_URL, ReplicaGroup, attach, healed_checkpoint
from lightning_spot.utils.distributed import broadcast_object, is_initialized
from lightning_spot.utils.units import parse_bytes
from lightning_spot.watchdog import DEFAULT_STEP_TIMEOUT, DEFAULT_TIMEOUT, JobWatch

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.accelerators import Accelerator
    from torch.distributed.device_mesh import DeviceMesh

_SUPPORTED_PRECISION = ("32-true", "16-mixed", "bf16-mixed", "bf16-true", "16-true", "64-true")


class SpotPipelineStrategy(CompiledModule, ParallelStrategy):
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
        microbatches: Union[int, list[int], Literal["auto"]] = "auto",
        schedule: str = "auto",
        stages_per_rank: Optional[int] = None,
        partition: Union[Literal["auto", "uniform", "balanced"], Sequence[int]] = "auto",
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
        if isinstance(microbatches, (list, tuple)):
            if isinstance(pipeline_stages, (int, str)) or len(microbatches) != len(pipeline_stages):
                raise LayoutError(
                    f"microbatches={list(microbatches)} gives one count per pipeline; it needs pipeline_stages as a list "
                    f"of as many depths (e.g. pipeline_stages=[2, 3], microbatches=[3, 5]), got {pipeline_stages!r}"
                )
            if any(not isinstance(m, int) or m < 1 for m in microbatches):
                raise LayoutError(f"microbatches must be positive ints, got {list(microbatches)}")
            microbatches = [int(m) for m in microbatches]
        elif microbatches != "auto" and (not isinstance(microbatches, int) or microbatches < 1):
            raise LayoutError(f"microbatches must be a positive int, a list of them or 'auto', got {microbatches!r}")
        if not isinstance(pipeline_stages, (int, str)):
            pipeline_stages = [int(p) for p in pipeline_stages]
        levels = offload_levels(offload)
        if schedule == "auto" and "parameters" in levels:
            schedule = "LoopedBFS"  # Harmony's order: a stage's weights come once for all micro-batches
        if schedule != "auto":
            resolve_schedule(schedule, stages_per_rank)  # unknown names fail here, not after start-up
        if isinstance(partition, str) and partition not in ("auto", "uniform", "balanced"):
            raise LayoutError(
                f"partition must be 'auto', 'uniform', 'balanced' or a list of cut indices, got {partition!r}"
            )
        self._requested = Requested(
            pipeline_stages=pipeline_stages,
            microbatches=microbatches,
            schedule=schedule,
            partition=partition if isinstance(partition, str) else [int(c) for c in partition],
            activation_checkpointing=activation_checkpointing,
            device_memory=parse_bytes(device_memory),
            stages_per_rank=stages_per_rank,
            offload=levels,
        )
        self._profile_cache = profile_cache
        #: host masters and optimizer state when ``offload="optimizer"`` (set up with the optimizers)
        self.offload: Optional[OptimizerOffload] = None
        self.layout_choice: Optional[LayoutChoice] = None
        self._layers = layers
        self._first_stage_modules = tuple(first_stage_modules)
        self._last_stage_modules = tuple(last_stage_modules)
        self._ddp_kwargs = {"find_unused_parameters": find_unused_parameters}
        self._pretrained = pretrained
        #: names of the pretrained tensors this rank read (empty without ``pretrained``)
        self.pretrained_reads: list[str] = []
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._step_timeout = step_timeout
        self._watch: Optional[JobWatch] = None
        self._sigterm: Optional[SigtermAgreement] = None
        #: the stream loaders made for Lightning (it cannot shut their DataLoaders' workers down itself)
        self._streams: weakref.WeakSet[Any] = weakref.WeakSet()
        self._fault_tolerance = resolve_fault_tolerance(fault_tolerance)
        #: this pipeline's torchft replica group (``fault_tolerance="torchft"``, once fitting starts)
        self.replicas: Optional[ReplicaGroup] = None
        self._num_nodes = 1
        self._device_mesh: Optional[DeviceMesh] = None
        self._layout: Optional[PipelineLayout] = None
        self.engine: Optional[PipelineEngine] = None
        #: time DDP's gradient all-reduce in timelines (set by ``PipelineTimeline`` before setup)
        self.trace_allreduce = False
        self.restored_manifest: Optional[dict[str, Any]] = None
        self.sources = StateSources()  # storage options, run directory, snapshots: where resumes read from
        #: this process's CPU thread setup (set when processes start)
        self.thread_setup: Optional[ThreadSetup] = None
        self.host_malloc: Optional[MallocSetup] = None
        self._user_threads = threads_set_by_user()

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
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def pipeline_layout(self) -> PipelineLayout:
        """The whole layout of this run: P x D, schedule, stages, cuts and micro-batches."""
        if self._layout is None:
            raise RuntimeError("The pipeline layout is known once the strategy has been set up.")
        return self._layout

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
        if self._layout is None:  # (setup samples a batch before the layout exists: one replica, all the data)
            return {"num_replicas": 1, "rank": 0}
        return {"num_replicas": self.layout.data_parallel, "rank": self.layout.dp_rank(self.global_rank)}

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    # -------------------------------------------------------------- environment
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def set_world_ranks(self) -> None:
        self._adopt_elastic_world()
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def _adopt_elastic_world(self) -> None:
        """Under torchrun, take this node's process count and the node count from the environment."""
        if self.cluster_environment and self.cluster_environment.creates_processes_externally and self.parallel_devices:
            self.parallel_devices, nodes = elastic_world(list(self.parallel_devices))
            self.num_nodes = nodes or self.num_nodes

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self.thread_setup = set_up_threads(self.num_processes, self._user_threads)
        self.host_malloc = keep_freed_host_memory()
        rank_zero_info(f"spot_pipeline: {self.thread_setup.describe()}; {self.host_malloc.describe()}")
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        destroy_process_group_at_exit()
        first_step = (self._timeout or DEFAULT_TIMEOUT).total_seconds()
        self._watch = JobWatch(
            self.global_rank, self._step_timeout, first_step_timeout=first_step, world=self.world_size
        )
        self._watch.start()

    def _watched(self, kind: str) -> AbstractContextManager[None]:
        """A pipeline step, watched for progress (a frozen peer stops the job after ``step_timeout``)."""
        if self._watch is None:
            return nullcontext()
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return self._watch.step(kind, f"{kind} at global step {trainer.global_step}" if trainer else kind)

    @override
    def on_train_start(self) -> None:  # Lightning's per-batch SIGTERM broadcast, without the lockstep
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and self._sigterm is None and self._fault_tolerance is None:
            self._sigterm = SigtermAgreement.install(trainer)

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self._watch is not None:
            self._watch.on_exception(exception)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        init = torch.device("meta") if empty_init else nullcontext()
        with init, self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` builds on the meta device; each rank materialises only its stages."""
        with torch.device("meta"):
            yield

    # -------------------------------------------------------------------- setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        self._check_supported(trainer, module)
        if self.engine is None:
            self.engine = self._build_engine(module)
            if self._pretrained:
                self._load_pretrained(module, self._pretrained)
            self.precision_plugin.convert_module(module)
            self.engine.wrap_data_parallel(
                trace_allreduce=self.trace_allreduce, stream_weights="parameters" in self._offloaded()
            )
            if "activations" in self._offloaded():
                self.engine.runner.activation_offload = ActivationOffload(self.root_device)
            self.engine.runner.grads_final.append(self._stage_grads_final)
        self.engine.runner.scaler = coordinated_scaler(self.precision_plugin)  # fp16: one loss scale everywhere
        # our sampler replaces Lightning's DistributedSampler (which would also reshuffle)
        trainer._accelerator_connector.use_distributed_sampler = False
        self.model = module
        if trainer.state.fn == TrainerFn.FITTING:  # (weights streamed from host memory: averages rest there too)
            on_stages(trainer, module, self.engine, streamed="parameters" in self._offloaded())
            checkpoints_last(trainer)
            self.setup_optimizers(trainer)
        writers_once_per_pipeline(trainer, self._engine().ctx.pp_rank)
        self.setup_precision_plugin()
        self._route_gradient_clipping()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
            if "optimizer" in self._offloaded():
                self.offload = self._engine().offload_optimizers(list(self.optimizers))
            if self._fault_tolerance is not None and self.replicas is None:
                self.replicas = attach(
                    trainer,
                    self.engine,
                    self._fault_tolerance,
                    group_size=self.world_size,
                    offloaded=bool(self.offload),
                )

    def _stage_grads_final(self, stage: int) -> None:
        """A stage's backward of the step is over: with the optimizer offloaded, its gradients start for the host."""
        if self.offload is not None:
            self.offload.copy_out(self._engine().stage_modules[stage].parameters())

    def _offloaded(self) -> tuple[str, ...]:
        """The offload levels of this run: as asked, or as the planner chose for ``offload="auto"``."""
        return self.layout_choice.offload if self.layout_choice is not None else ()

    def _check_supported(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if not module.automatic_optimization:
            raise ModelContractError(
                "spot_pipeline runs forward and backward of all micro-batches inside one pipeline schedule, so it "
                "needs automatic optimization; remove `self.automatic_optimization = False` / manual_backward."
            )
        precision = str(getattr(self.precision_plugin, "precision", "32-true"))
        if precision not in _SUPPORTED_PRECISION:
            raise LayoutError(
                f"precision={precision!r} is not supported by spot_pipeline. Use one of {list(_SUPPORTED_PRECISION)}."
            )
        levels = self._requested.offload
        if precision == "16-mixed" and levels != "auto" and {"optimizer", "parameters"} & set(levels):
            raise LayoutError(
                f"precision='16-mixed' with offload={list(levels)} is not supported yet (the gradient scaler would "
                f"unscale gradients in host memory). Use precision='bf16-mixed' with offload, or fp16 without it."
            )

    def _build_engine(self, module: pl.LightningModule) -> PipelineEngine:
        previous = placement_of(module)
        sample = shared_sample_batch(module.trainer) if previous is None else None
        split = previous.split if previous is not None else self._split(module, sample)
        choice = module.__dict__.get("_spot_layout_choice") if previous is not None else None
        if choice is None:
            places = self._plan_places()
            choice = choose_layout(
                module,
                split,
                self._requested,
                sample,
                world_size=self.world_size,
                device=self.root_device,
                autocast=self.precision_plugin.forward_context,
                cache_dir=Path(os.path.expanduser(self._profile_cache)) if self._profile_cache else None,
                plan_places=places,
                run_place=places[0] if self.sources.run_url else None,
                measured=self._fault_tolerance is None,  # torchft's pipelines decide alone: alike, not measured
            )
        module.__dict__["_spot_layout_choice"] = self.layout_choice = choice
        describe_choice(choice)
        self._layout = layout = choice.layout
        grid = layout.grid
        if is_initialized() and grid.is_mixed:
            pp_group, dp_group = mixed_groups(grid, self.global_rank)
        elif is_initialized():
            self._device_mesh = grid.device_mesh(self.root_device.type)
            pp_group, dp_group = self._device_mesh.get_group("pp"), self._device_mesh.get_group("dp")
        else:
            pp_group = dp_group = None
        ctx = ParallelContext(
            pp_rank=grid.pp_rank(self.global_rank),
            dp_rank=grid.dp_rank(self.global_rank),
            pp_group=pp_group,
            dp_group=dp_group,
            device=self.root_device,
        )
        engine = PipelineEngine(
            module,
            split,
            layout,
            ctx,
            seed=int(os.environ.get("PL_GLOBAL_SEED", 0)),
            ddp_kwargs=self._ddp_kwargs,
            activation_checkpointing=choice.activation_checkpointing,
            compiler=self._compiler,
            outside_timeout=self._step_timeout or DEFAULT_STEP_TIMEOUT,
        )
        rank_zero_info(f"spot_pipeline: {engine.describe()}")
        return engine

    def _split(self, module: pl.LightningModule, sample: Optional[tuple[int, Any]]) -> ModelSplit:
        """The layer sequence and the stage of each module beside it: where one run of the step on a sample of
        the training data uses it, else by registration order (collective when there is a sample)."""
        split = discover(
            module,
            self._layers,
            first_stage_modules=self._first_stage_modules,
            last_stage_modules=self._last_stage_modules,
        )
        if sample is None:
            return split
        size, batch = sample
        fixed = (*self._first_stage_modules, *self._last_stage_modules)
        placed = place_by_run(module, split, first_samples(batch, size, 1), fixed) if self.global_rank == 0 else None
        return broadcast_object(placed)

    def _load_pretrained(self, module: pl.LightningModule, path: str) -> None:
        weights = SafetensorsWeights(path)
        count = load_stage_weights(module, weights, self.tied_aliases)
        self.pretrained_reads = list(weights.read_names)
        rank_zero_info(
            f"spot_pipeline: {count} pretrained tensors of this rank's stages read from {path} "
            f"({weights.read_bytes / 2**20:.1f} MiB; rank 0)"
        )

    def _route_gradient_clipping(self) -> None:
        """Clip by the global norm over all stages instead of each rank's local norm."""
        engine = self._engine()
        scope = norm_scope(engine.layout.is_mixed, engine.ctx.pp_group, engine.ctx.dp_rank, engine.ties.duplicates)
        self.precision_plugin.clip_grad_by_norm = global_norm_clipping(  # type: ignore[method-assign,assignment]
            scope, self.root_device
        )
        grad_norms.use_scope(scope)  # (lightning_spot.grad_norm: the norms of every stage's gradients)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if self.engine is not None and self.engine.runner.weights is not None:
            return  # offload="parameters": the weights rest in host memory and come to the device per stage
        self.model.to(self.root_device)

    # -------------------------------------------------------------------- steps
    def _engine(self) -> PipelineEngine:
        if self.engine is None:
            raise RuntimeError("spot_pipeline has not been set up yet")
        return self.engine

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.train_step_context(), self._watched("training_step"):
            engine, batch, size, module = self._engine(), args[0], None, self.lightning_module
            if self.replicas is not None:  # this pipeline's rows of the global batch, among those in the quorum
                batch, size = self.replicas.begin_step(batch, engine.microbatches, module.global_step if module else 0)
            release = module is not None and zeroed_after_step(module.trainer, module)
            return engine.train_step(batch, args[1:], kwargs, global_batch=size, release_grads=release)

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """(Lightning, around a batch it accumulates) the replicas average the gradients at the last batch only."""
        with self._engine().replica_sync_deferred():
            yield

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self.offload is None:
            return self._step(optimizer, closure, model, **kwargs)
        with self.offload.updating(optimizer, closure) as on_host:  # the update (and clipping) run on the host
            return self._step(optimizer, on_host, model, **kwargs)

    def _step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self.replicas is not None:  # gradients averaged over the quorum; the update only when the step commits
            engine = self._engine()
            closure = self.replicas.committed(closure, lambda: engine.runner.loss_weights.items, engine.keep_step)
        clock = self.engine.clock if self.engine is not None else None
        if clock is None or clock.timeline is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        # the closure runs training_step (the schedule) first; time only the update after it
        def timed_closure() -> Any:
            result = closure()
            stack.enter_context(clock.span("optimizer", "optimizer"))
            return result

        with ExitStack() as stack:
            return super().optimizer_step(optimizer, timed_closure, model, **kwargs)

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
        self._engine().restore_grads(scale=1.0 / accumulate)
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

    # --------------------------------------------------------------------- data
    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        self._engine().runner.seed_hooks()  # (the transfer hooks' augmentations draw alike on every stage)
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        self._engine().runner.seed_hooks()  # (and the first batch's on_before_batch_transfer)
        if not isinstance(dataloader, DataLoader):
            return dataloader
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        epoch_loop = trainer.fit_loop.epoch_loop if trainer is not None and trainer.training else None
        layout = self.pipeline_layout
        share: dict[str, Any] = {  # progress: global batches trained this epoch (the same on every layout)
            "dp_rank": self._engine().ctx.dp_rank,
            "dp_size": layout.grid.data_parallel,
            "weights": layout.pipeline_microbatches if layout.is_mixed else None,
            "divisor": layout.total_microbatches if epoch_loop is not None else None,
            "progress": (lambda: epoch_loop.batch_progress.current.processed) if epoch_loop else None,  # type: ignore[attr-defined]
            "world_size": layout.grid.world_size,
        }
        if is_stream(dataloader):  # read on the first stage only (every stage under torchft or mixed depths)
            fed, ctx = self._fault_tolerance is None and not layout.is_mixed, self._engine().ctx
            stream = stage_feed(stream_dataloader(dataloader, **share), ctx.pp_group if fed else None, ctx.pp_rank == 0)
            self._streams.add(stream)  # (their workers are shut down at teardown)
            return stream
        return shard_dataloader(dataloader, seed=int(os.environ.get("PL_GLOBAL_SEED", 0)), **share)

    # ------------------------------------------------------------- checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer state keyed by parameter name (flattened), so that any layout can read it."""
        from lightning.pytorch.core.optimizer import LightningOptimizer

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        assert self.lightning_module is not None
        return payload.stored_names(flat_optimizer.optimizer_state(self.lightning_module, optimizer), self.tied_aliases)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's parameters and buffers under the names checkpoints store (a tied parameter once)."""
        return payload.stored_names(super().lightning_module_state_dict(), self.tied_aliases)

    @property
    def tied_aliases(self) -> dict[str, str]:
        """This rank's other names of tied parameters -> the name checkpoints store them under."""
        return self.engine.ties.aliases if self.engine is not None else {}

    def checkpoint_info(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """Step, layout and data position for a checkpoint manifest."""
        engine = self._engine()
        return {
            "step": int(checkpoint.get("global_step", 0)),
            "epoch": int(checkpoint.get("epoch", 0)),
            "layout": self.pipeline_layout.to_dict(),
            "data": {"global_batch": engine.last_global_batch, "samples_consumed": engine.samples_seen},
            "tied": dict(engine.ties.aliases),
            "pretrained": pretrained_record.describe(engine.module),
        }

    def use_checkpoint_storage(
        self,
        storage_options: dict[str, Any],
        run_url: Optional[str] = None,
        snapshots: Optional[SnapshotStore] = None,
    ) -> None:
        """fsspec options for checkpoint URLs (``SpotCheckpoint`` hands over its own; also used by
        ``fit(ckpt_path=URL)`` and ``ModelCheckpoint``), the run directory, where plans are remembered, and
        the in-memory snapshots that ``ckpt_path="snapshot://STEP"`` resumes from."""
        self.sources.use(storage_options, run_url, snapshots)

    def newest_snapshot(self) -> tuple[Optional[int], str]:
        """Collective: the newest step the surviving in-memory snapshots hold completely for this layout."""
        assert self.lightning_module is not None
        return self.sources.newest_snapshot(self.lightning_module, list(self.optimizers), self.tied_aliases)

    def _plan_places(self) -> list[PlanPlace]:
        """Where the plan of this job is remembered: its run directory (follows the job) and the local cache."""
        places = []
        if self.sources.run_url:
            places.append(PlanPlace(self.sources.run_url.rstrip("/") + "/plans", self.sources.storage_options))
        if self._profile_cache:
            places.append(PlanPlace(os.path.join(os.path.expanduser(self._profile_cache), "plans")))
        return places

    @property
    def replica_group_id(self) -> Optional[str]:
        return self._fault_tolerance.resolved().replica_group if self._fault_tolerance is not None else None

    def fault_events(self) -> list[dict[str, Any]]:
        return self.replicas.take_events() if self.replicas is not None else []

    @property
    def writes_checkpoints(self) -> bool:
        return self.replicas is None or self.replicas.participant_rank == 0

    @property
    def last_global_batch(self) -> Optional[int]:
        """Samples in the last trained global batch (``None`` before the first step)."""
        return self.engine.last_global_batch if self.engine is not None else None

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write a sharded checkpoint directory at ``filepath`` (any fsspec URL; what ModelCheckpoint asks for)."""
        url = self.broadcast(str(filepath))
        share = payload.split_checkpoint(
            checkpoint, copy=False, with_lightning=self.is_global_zero, aliases=self.tied_aliases
        )
        options = storage_options if storage_options is not None else self.sources.storage_options
        write.write_checkpoint(Storage(url, options), "", share, info=self.checkpoint_info(checkpoint))
        self.barrier("spot_pipeline.save_checkpoint")

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load a checkpoint (or the latest intact one of a run directory) written on any layout onto this one."""
        assert self.lightning_module is not None
        url = self.broadcast(str(checkpoint_path))
        if url == HEAL_URL and self.replicas is not None:
            checkpoint, self.restored_manifest = healed_checkpoint(
                self.replicas, self.lightning_module, list(self.optimizers), self._engine()
            )
            return checkpoint
        started = time.monotonic()
        # with offload, weights and optimizer state are read straight into the host masters
        with self.offload.on_host(list(self.optimizers)) if self.offload is not None else nullcontext():
            checkpoint, record, tier = self.sources.load(
                url,
                self.lightning_module,
                list(self.optimizers),
                layout=self.pipeline_layout,
                aliases=self.tied_aliases,
            )
        self._engine().samples_seen = int(record.get("data", {}).get("samples_consumed") or 0)
        self.restored_manifest = {**record, "tier": tier, "restore_seconds": time.monotonic() - started}
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # done in load_checkpoint, resharded by parameter name

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # done in load_checkpoint

    # -------------------------------------------------------------- collectives
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

    @override
    def teardown(self) -> None:
        grad_norms.use_scope(None)
        if self._sigterm is not None:
            self._sigterm.uninstall()
            self._sigterm = None
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        if self.replicas is not None:
            self.replicas.shutdown()
            self.replicas = None
        for stream in list(self._streams):
            stream.close()
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
