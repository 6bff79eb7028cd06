"""This process, set up for pipelined training: CPU threads, host memory reuse, the process group, the watchdog.

    process = ProcessSetup.start(processes=4, user_threads=None, environment=env, device=dev, backend=None,
                                 timeout=timedelta(minutes=10), step_timeout=60.0, rank=0, world_size=4)
    with process.watched("training_step", "training_step at global step 12"): ...
    process.stop()

Each resource is set up here once; ``stop`` (the strategy's teardown) ends what keeps running (the watchdog).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device, _init_dist_connection
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_spot.runtime.host_malloc import MallocSetup, keep_freed_host_memory
from lightning_spot.runtime.process import ThreadSetup, destroy_process_group_at_exit, set_up_threads
from lightning_spot.watchdog import DEFAULT_TIMEOUT, JobWatch


@dataclass
class ProcessSetup:
    """What :meth:`start` set up: the threads, host memory reuse, the backend, the job's watchdog."""

    threads: ThreadSetup
    host_malloc: MallocSetup
    backend: str
    watch: Optional[JobWatch]

    @classmethod
    def start(
        cls,
        *,
        processes: int,
        user_threads: Any,
        environment: ClusterEnvironment,
        device: torch.device,
        backend: Optional[str],
        timeout: Optional[timedelta],
        step_timeout: Optional[float],
        rank: int,
        world_size: int,
    ) -> ProcessSetup:
        """Threads sized for the node's processes, freed host memory kept, the process group up (destroyed at
        exit), and a watchdog that stops every rank when one fails or a step makes no progress."""
        threads = set_up_threads(processes, user_threads)
        malloc = keep_freed_host_memory()
        rank_zero_info(f"spot_pipeline: {threads.describe()}; {malloc.describe()}")
        backend = backend or _get_default_process_group_backend_for_device(device)
        kwargs: dict[str, Any] = {"timeout": timeout}
        if device.type != "cpu":
            kwargs["device_id"] = device
        _init_dist_connection(environment, backend, **kwargs)
        destroy_process_group_at_exit()
        first_step = (timeout or DEFAULT_TIMEOUT).total_seconds()
        watch = JobWatch(rank, step_timeout, first_step_timeout=first_step, world=world_size)
        watch.start()
        return cls(threads, malloc, backend, watch)

    def watched(self, kind: str, label: str) -> AbstractContextManager[None]:
        """A pipeline step, watched for progress (a frozen peer stops the job after ``step_timeout``)."""
        return self.watch.step(kind, label) if self.watch is not None else nullcontext()

    def on_exception(self, exception: BaseException) -> None:
        if self.watch is not None:
            self.watch.on_exception(exception)

    def stop(self) -> None:
        if self.watch is not None:
            self.watch.stop()
            self.watch = None
