"""Weights on the device only while their stage computes (``offload="parameters"``, Harmony's core).

    weights = WeightStreaming(stage_modules, device, dp_group)   # every weight now rests in host memory
    weights.begin(("train", 4))      # before a schedule: the stage order it ran last time drives the prefetch
    weights.use(stage)               # before a stage's forward / backward chunk: resident, the next one prefetched
    weights.backward_done(stage)     # after its last backward chunk: gradients averaged over replicas, sent to
                                     # the host, the weights released
    weights.finish()                 # after the schedule: nothing stays on the device

Only the layer sequence's weights stream; embeddings and heads beside it stay on the device. At rest each
streamed parameter *is* its fp32 host master (``p.data``, pinned on GPUs): the optimizer (``"optimizer"``, which
this level implies) updates it in place on the host, and checkpoints and snapshots read it there. Each parameter
also keeps a device tensor whose storage is resized to zero when released and refilled from the master before use
(FSDP's trick): the views of the weights that autograd saved in the forward keep pointing at that storage, so the
backward, which may come much later, computes with the same weights (bit-identical gradients; see the tests).

The unit is a pipeline stage. With a looped breadth-first schedule (``schedule="LoopedBFS"``, ``stages_per_rank``
= layers per rank) each stage is one layer and runs all micro-batches at once: its weights come to the device once
for the forward and once for the backward of every step, as Harmony does, while the next stage's weights are
copied on a side stream. Other schedules work too (same math) but may bring a stage back once per micro-batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors

from lightning_spot.partition.discovery import ModelContractError
from lightning_spot.runtime.last_order import LastOrder


class WeightStreaming:
    """Residency of this rank's stages' weights: at most the active stage and the prefetched next one."""

    def __init__(
        self,
        stages: Mapping[int, Sequence[nn.Module]],
        device: torch.device,
        dp_group: dist.ProcessGroup | None = None,
        synced: Mapping[int, nn.Module] | None = None,
    ) -> None:
        """``stages``: each local stage's layers (of the layer sequence; modules beside it, such as embeddings and
        the output head, stay on the device: they also run, as stand-ins' inputs, when other stages compute).
        ``synced``: each stage's whole module, whose gradients are averaged over ``dp_group`` (default: the layers)."""
        self.device = device
        self.cuda = device.type == "cuda"
        self.dp_group = dp_group
        #: every local stage's parameters (a parameter used by two local stages appears in both)
        self.stage_params: dict[int, list[nn.Parameter]] = {}
        #: id(parameter) -> its host master (fp32 for floating point), what the parameter is at rest
        self.masters: dict[int, Tensor] = {}
        self._device: dict[int, Tensor] = {}
        self._bytes: dict[int, int] = {}
        for stage, layers in sorted(stages.items()):
            self.stage_params[stage] = list(dict.fromkeys(p for layer in layers for p in layer.parameters()))
            for p in self.stage_params[stage]:
                if id(p) not in self.masters:
                    self._rest(p)
        #: each stage's parameters whose gradients are averaged over the replicas (streamed or not)
        self.synced_params = {
            s: list(synced[s].parameters()) if synced is not None else self.stage_params[s] for s in self.stage_params
        }
        self.active: int | None = None
        self.prefetched: int | None = None
        #: gradient averages in flight: (work, flat gradients, their parameters)
        self._averaging: list[tuple[dist.Work, Tensor, list[nn.Parameter]]] = []
        self._on_device: set[int] = set()
        self._ready: dict[int, torch.cuda.Event] = {}
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._order = LastOrder()
        #: stage loads so far and the bytes they copied to the device
        self.loads = 0
        self.loaded_bytes = 0
        #: weight bytes on the device now, at most so far, and all the streamed weights' bytes
        self.resident_bytes = 0
        self.peak_bytes = 0
        self.total_bytes = sum(self._bytes.values())

    @torch.no_grad()
    def _rest(self, p: nn.Parameter) -> None:
        dev = p.data
        storage = dev.untyped_storage()
        if dev.storage_offset() != 0 or storage.nbytes() != dev.numel() * dev.element_size():
            raise ModelContractError(
                "offload='parameters' needs every parameter in a storage of its own (this one is a view into a larger "
                "tensor); create the parameters separately, or use offload='optimizer'."
            )
        master = torch.empty(
            dev.shape, dtype=torch.float32 if dev.is_floating_point() else dev.dtype, pin_memory=self.cuda
        )
        master.copy_(dev)
        p.data = master
        self.masters[id(p)] = master
        self._device[id(p)] = dev
        self._bytes[id(p)] = storage.nbytes()
        storage.resize_(0)

    # ---------------------------------------------------------------- residency
    def device_tensor(self, p: Tensor) -> Tensor:
        """The device tensor ``p`` computes with (zero-sized storage while released)."""
        return self._device[id(p)]

    def resident_stages(self) -> set[int]:
        """The stages whose weights have device storage now (the active one and the prefetched one)."""
        return {s for s, params in self.stage_params.items() if all(id(p) in self._on_device for p in params)}

    def stage_bytes(self, stage: int) -> int:
        return sum(self._bytes[id(p)] for p in self.stage_params[stage])

    @torch.no_grad()
    def _load(self, stage: int) -> None:
        params = [p for p in self.stage_params[stage] if id(p) not in self._on_device]
        if not params:
            return
        for p in params:
            self._device[id(p)].untyped_storage().resize_(self._bytes[id(p)])  # allocated on the compute stream
        stream = self._stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for p in params:
                self._device[id(p)].copy_(self.masters[id(p)], non_blocking=self.cuda)
        if stream is not None:
            self._ready[stage] = stream.record_event()
        for p in params:
            grad = p.grad  # a gradient sent to the host earlier in this step (a stage used again) comes back
            p.grad = None
            dev = self._device[id(p)]
            p.data = dev
            if grad is not None:
                p.grad = grad.to(device=dev.device, dtype=dev.dtype)
            self._on_device.add(id(p))
        loaded = sum(self._bytes[id(p)] for p in params)
        self.loads += 1
        self.loaded_bytes += loaded
        self.resident_bytes += loaded
        self.peak_bytes = max(self.peak_bytes, self.resident_bytes)

    @torch.no_grad()
    def _release(self, stage: int) -> None:
        ready = self._ready.pop(stage, None)
        if ready is not None:  # prefetched, never used: its copy must be over before its memory is freed
            torch.cuda.current_stream(self.device).wait_event(ready)
        keep = {
            id(p) for s in (self.active, self.prefetched) if s is not None and s != stage for p in self.stage_params[s]
        }
        for p in self.stage_params[stage]:
            if id(p) in keep or id(p) not in self._on_device:
                continue
            grad = p.grad
            p.grad = None
            master = self.masters[id(p)]
            p.data = master
            if grad is not None:
                p.grad = grad.to(device=master.device, dtype=master.dtype)
            self._device[id(p)].untyped_storage().resize_(0)
            self._on_device.discard(id(p))
            self.resident_bytes -= self._bytes[id(p)]

    # ---------------------------------------------------------------- schedule hooks
    def begin(self, key: Hashable) -> None:
        """A schedule starts; ``key`` names it (the stage order of its last run is the prefetch order)."""
        self._order.begin(key)

    def use(self, stage: int, record: bool = True) -> None:
        """``stage`` computes next: its weights are made resident (waiting for their copy) and, when the order of
        the last run of this schedule is known, the stage after it is prefetched."""
        if stage != self.active:
            previous, self.active = self.active, stage
            if previous is not None:
                self._release(previous)
            if self.prefetched is not None and self.prefetched != stage:
                self._release(self.prefetched)
            self.prefetched = None
            self._load(stage)
            if record:
                upcoming = self._order.next_after(stage)
                if isinstance(upcoming, int) and upcoming != stage:
                    self.prefetched = upcoming
                    self._load(upcoming)
        ready = self._ready.pop(stage, None)
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)

    def backward_done(self, stage: int) -> None:
        """``stage`` has had its last backward chunk of the step: its weights are released and its gradients
        averaged over the data-parallel replicas (on the device, asynchronously: the average runs while the next
        stage's backward does, and lands in host memory when that one is done too), else moved to the host."""
        if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            self._land_average()  # the previous stage's, overlapped with this stage's backward
            self._start_average(stage)
        if self.active == stage:
            self.active = None
        self._release(stage)

    @torch.no_grad()
    def _start_average(self, stage: int) -> None:
        params = [p for p in self.synced_params[stage] if p.grad is not None]
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in params:
            assert p.grad is not None
            by_dtype.setdefault(p.grad.dtype, []).append(p)
        for group in by_dtype.values():
            flat = _flatten_dense_tensors([p.grad for p in group])
            work = dist.all_reduce(flat, group=self.dp_group, async_op=True)
            self._averaging.append((work, flat, group))
        for p in params:
            p.grad = None  # the gradient lives on in the flat buffer until the average lands

    @torch.no_grad()
    def _land_average(self) -> None:
        """Wait for the gradient averages in flight; streamed weights' gradients go to the host (next to their
        masters), those of modules that stay on the device stay there."""
        size = dist.get_world_size(self.dp_group)
        for work, flat, group in self._averaging:
            work.wait()
            flat.div_(size)
            offset = 0
            for p in group:
                grad = flat.narrow(0, offset, p.numel()).view(p.shape)
                offset += p.numel()
                master = self.masters.get(id(p))
                if master is not None and id(p) not in self._on_device:
                    landed = grad.to(device=master.device, dtype=master.dtype)
                else:
                    landed = grad.clone()
                if p.grad is not None:  # accumulated since (a parameter that two local stages use)
                    landed = p.grad + landed.to(device=p.grad.device, dtype=p.grad.dtype)
                p.grad = landed
        self._averaging = []

    def finish(self) -> None:
        """The schedule is over: every weight back at rest in host memory, every gradient average landed, the
        stage order kept for next time."""
        stages = [s for s in (self.active, self.prefetched) if s is not None]
        self.active = self.prefetched = None
        for stage in stages:
            self._release(stage)
        if self._averaging:
            self._land_average()
        self._order.end()

    @contextmanager
    def resident(self, stage: int) -> Iterator[None]:
        """``stage``'s weights on the device inside (torch's set-up passes outside the recorded order)."""
        self.use(stage, record=False)
        yield
