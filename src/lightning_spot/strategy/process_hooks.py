"""The strategy's hooks of the process: its place in the world, its set-up, the watchdog around steps.

    class SpotPipelineStrategy(..., ProcessHooks, ...): ...   # setup_environment, set_world_ranks, _watched...

Under torchrun the world is the one the environment says (an elastic restart may bring fewer or more nodes than
the Trainer was given); Lightning's own launcher starts the processes otherwise. ``setup_environment`` sets the
process up once (``ProcessSetup``); every pipeline step runs watched (a frozen peer stops the job after
``step_timeout``). ``configure_model`` builds on the meta device: each rank materialises only its stages.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from typing import Any, Optional

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from typing_extensions import override

from lightning_spot.preemption.lightning_sigterm import SigtermAgreement
from lightning_spot.preemption.step_agreement import StepAgreement
from lightning_spot.runtime.process import elastic_world
from lightning_spot.strategy.process import ProcessSetup
from lightning_spot.strategy.settings import PipelineSettings


class ProcessHooks(ParallelStrategy):
    """This process in the job (a mixin of ``SpotPipelineStrategy``, which sets what is declared here)."""

    settings: PipelineSettings
    process: Optional[ProcessSetup]
    _num_nodes: int
    _user_threads: Any
    _process_group_backend: Optional[str]
    _sigterm: Optional[SigtermAgreement]
    step_agreement: StepAgreement

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
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @property
    def thread_setup(self) -> Any:
        return self.process.threads if self.process is not None else None

    @property
    def host_malloc(self) -> Any:
        return self.process.host_malloc if self.process is not None else None

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def set_world_ranks(self) -> None:
        env = self.cluster_environment
        if env is not None and env.creates_processes_externally and self.parallel_devices:  # torchrun: its world
            self.parallel_devices, nodes = elastic_world(list(self.parallel_devices))
            self.num_nodes = nodes or self.num_nodes
        if env is not None:
            env.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            env.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        self.process = ProcessSetup.start(
            processes=self.num_processes, user_threads=self._user_threads, environment=self.cluster_environment,
            device=self.root_device, backend=self._process_group_backend, timeout=self.settings.timeout,
            step_timeout=self.settings.step_timeout, rank=self.global_rank, world_size=self.world_size,
        )  # fmt: skip
        self._process_group_backend = self.process.backend

    def _watched(self, kind: str) -> Any:
        """A pipeline step, watched for progress (a frozen peer stops the job after ``step_timeout``)."""
        if self.process is None:
            return nullcontext()
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return self.process.watched(kind, f"{kind} at global step {trainer.global_step}" if trainer else kind)

    @override
    def on_train_start(self) -> None:  # Lightning's per-batch SIGTERM broadcast, without the lockstep
        self.step_agreement.reset()
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and self._sigterm is None and self.settings.fault_tolerance is None:
            self._sigterm = SigtermAgreement.install(trainer, self.step_agreement)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.step_agreement.post(self.root_device)  # settled after the optimizer step (``optimizer_step``)

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self.process is not None:
            self.process.on_exception(exception)

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
