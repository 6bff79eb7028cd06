"""What the planner needs to know about the machine: device memory, compute sharing, network and
optimizer speed; measured on the job's own process group.

    base = default_hardware(device, memory=None, local_processes=4)   # memory and CPU sharing
    hardware = measure_hardware(device, base)                          # collective: p2p, all-reduce, optimizer
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_spot.utils.distributed import world_size


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPUs), so that a clock reading means something."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Hardware:
    """What the step-time and memory model needs to know about the devices and the network."""

    memory_bytes: float | None = None
    p2p_bytes_per_s: float = 10e9
    p2p_latency_s: float = 30e-6
    allreduce_bytes_per_s: float = 10e9
    allreduce_latency_s: float = 50e-6
    #: optimizer update speed, bytes of training state per second
    optimizer_bytes_per_s: float = 100e9
    #: parameters + gradients + optimizer state, per byte of parameters (Adam: 4)
    state_factor: float = 4.0
    #: > 1 when several processes share one device's compute (CPU cores)
    compute_slowdown: float = 1.0
    #: fixed cost per micro-batch and stage (Python, kernel launches, Lightning)
    microbatch_overhead_s: float = 1e-3
    #: host memory per process (offload keeps training state there); ``None``: unknown, not checked
    host_memory_bytes: float | None = None
    #: copies between device and host memory (PCIe on GPUs; a memory copy on CPUs)
    host_copy_bytes_per_s: float = 12e9
    #: optimizer update speed on the host (offloaded optimizer), bytes of training state per second
    host_optimizer_bytes_per_s: float = 2e9
    #: fixed cost per step outside the schedule: Lightning's loop and hooks, handing the gradients
    #: over, sharing the loss and logged values from the last stage (6 ms on the CPUs of
    #: ``benchmarks/planner.py``'s traces; a rough default elsewhere)
    step_overhead_s: float = 6e-3


def default_hardware(device: torch.device, memory: float | None, local_processes: int) -> Hardware:
    """Memory per device and, on CPUs, how much the processes of a node slow each other down."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024 / max(local_processes, 1)
    except OSError:
        pass
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return Hardware(memory_bytes=memory or 0.9 * total, optimizer_bytes_per_s=500e9, host_memory_bytes=available)
    cores = os.cpu_count() or 1
    slowdown = max(1.0, local_processes * torch.get_num_threads() / cores)
    return Hardware(
        memory_bytes=memory or available,
        host_memory_bytes=available,
        compute_slowdown=slowdown,
        optimizer_bytes_per_s=2e9,
        p2p_bytes_per_s=2e9,
        allreduce_bytes_per_s=1e9,
    )


def measure_hardware(device: torch.device, base: Hardware, *, megabytes: int = 25, repeats: int = 3) -> Hardware:
    """Calibrate the optimizer update speed here, and point-to-point and all-reduce speed on the default
    process group (a collective call; every rank gets rank 0's figures)."""

    def optimizer_speeds(base: Hardware) -> Hardware:
        speed = _optimizer_speed(device, base.state_factor)
        host = speed if device.type == "cpu" else _optimizer_speed(torch.device("cpu"), base.state_factor)
        return replace(base, optimizer_bytes_per_s=speed, host_optimizer_bytes_per_s=host)

    if world_size() < 2:
        return optimizer_speeds(base)
    if dist.get_rank() == 0:  # alone: ranks updating at once would share the memory bandwidth
        base = optimizer_speeds(base)
    rank, world = dist.get_rank(), dist.get_world_size()
    buf = torch.zeros(megabytes * 2**18, device=device)  # 4-byte floats
    small = torch.zeros(1, device=device)

    def timed(fn: Any) -> float:
        fn()
        sync_device(device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        sync_device(device)
        return (time.perf_counter() - start) / repeats

    def ping(t: torch.Tensor) -> None:
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        elif rank == 1:
            dist.recv(t, 0)
            dist.send(t, 0)

    big_rtt, small_rtt = timed(lambda: ping(buf)), timed(lambda: ping(small))
    big_ar, small_ar = timed(lambda: dist.all_reduce(buf)), timed(lambda: dist.all_reduce(small))
    values = torch.tensor(
        [big_rtt, small_rtt, big_ar, small_ar, base.optimizer_bytes_per_s, base.host_optimizer_bytes_per_s],
        dtype=torch.float64,
        device=device,
    )
    dist.broadcast(values, 0)  # rank 0's view, so that every rank plans the same
    big_rtt, small_rtt, big_ar, small_ar, optimizer_speed, host_optimizer_speed = values.tolist()
    nbytes = buf.numel() * 4
    latency = max(small_rtt / 2, 1e-6)
    ring = 2 * (world - 1) / world
    return replace(
        base,
        optimizer_bytes_per_s=optimizer_speed,
        host_optimizer_bytes_per_s=host_optimizer_speed,
        p2p_latency_s=latency,
        p2p_bytes_per_s=nbytes / max(big_rtt / 2 - latency, 1e-9),
        allreduce_latency_s=max(small_ar / (2 * (world - 1)), 1e-6),
        allreduce_bytes_per_s=ring * nbytes / max(big_ar - small_ar, 1e-9),
    )


def _optimizer_speed(device: torch.device, state_factor: float, megabytes: int = 32, repeats: int = 3) -> float:
    """Bytes of training state (parameters x ``state_factor``) an AdamW step updates per second here
    (the fastest of ``repeats`` steps, after two that allocate and touch the state)."""
    # layer-sized tensors of ordinary values: zeros or tiny steps make a CPU update ~1.6x slower (denormals)
    weights = [torch.randn(megabytes * 2**15, device=device).requires_grad_() for _ in range(8)]
    for weight in weights:
        weight.grad = torch.randn_like(weight)
    optimizer = torch.optim.AdamW(weights, lr=1e-3)
    best = float("inf")
    for i in range(2 + repeats):
        sync_device(device)
        start = time.perf_counter()
        optimizer.step()
        sync_device(device)
        if i >= 2:
            best = min(best, time.perf_counter() - start)
    return state_factor * sum(w.numel() * w.element_size() for w in weights) / max(best, 1e-9)
