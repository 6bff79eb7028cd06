"""Training state in host memory: the optimizer's (``offload="optimizer"``) and saved activations (``"activations"``).

    offload = OptimizerOffload(optimizers)   # fp32 host copies of every parameter the optimizers update
    offload.to_host(optimizer)               # after backward: each parameter *is* its host master, grads copied out
    optimizer.step()                         # the update, and the state it creates, run in host memory
    offload.to_device(optimizer)             # the updated weights copied back; the device keeps no optimizer state

The parameters keep their identity: during the update each one's ``.data`` is swapped for its host master
(fp32, pinned when the device is a GPU) and its gradient for a host copy. The optimizer, unchanged, creates its
state next to the master (``zeros_like``), so Adam's moments never take device memory, and checkpoints, which
map optimizer state to parameter names by identity, read it where it lives. With bf16 weights on the device
the masters keep fp32 precision (the update is computed in fp32 and rounded once when copied back).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor


class OptimizerOffload:
    """Host masters for the parameters of some optimizers, and the swap around each update."""

    def __init__(
        self,
        optimizers: list[torch.optim.Optimizer],
        host: torch.device = torch.device("cpu"),
        masters: Mapping[int, Tensor] | None = None,
    ) -> None:
        """``masters``: host masters that exist already, by ``id(parameter)`` (``offload="parameters"``: those
        parameters rest on their master between steps, and nothing is swapped for them)."""
        self.host = host
        self.params: list[Tensor] = []
        self.masters: dict[int, Tensor] = {}
        self._device: dict[int, Tensor] = {}
        given = masters or {}
        for opt in optimizers:
            for p in _params(opt):
                if id(p) not in self.masters:
                    self.params.append(p)
                    self.masters[id(p)] = given[id(p)] if id(p) in given else self._host_copy(p.detach())
        for opt in optimizers:
            self.state_to_host(opt)

    def _host_copy(self, t: Tensor) -> Tensor:
        out = torch.empty(t.shape, dtype=torch.float32 if t.is_floating_point() else t.dtype, device=self.host)
        if t.device.type == "cuda":
            out = out.pin_memory()
        out.copy_(t)
        return out

    @contextmanager
    def on_host(self, optimizers: list[torch.optim.Optimizer]) -> Iterator[None]:
        """Every parameter is its host master inside (a checkpoint being loaded fills the masters and the host
        optimizer state directly); the device tensors take the masters' values on the way out."""
        swapped = [p for p in self.params if not self._at_rest(p)]
        for p in swapped:
            self._device[id(p)] = p.data
            p.data = self.masters[id(p)]
        try:
            yield
        finally:
            with torch.no_grad():
                for p in swapped:
                    device = self._device.pop(id(p))
                    master = p.data
                    p.data = device
                    device.copy_(master)
            for opt in optimizers:
                self.state_to_host(opt)

    @torch.no_grad()
    def to_host(self, optimizer: torch.optim.Optimizer) -> None:
        """Make every parameter of ``optimizer`` its host master, with its gradient copied to the host."""
        for p in _params(optimizer):
            master = self.masters[id(p)]
            grad = p.grad
            p.grad = None
            if not self._at_rest(p):
                self._device[id(p)] = p.data
                p.data = master
            if grad is not None:
                p.grad = grad.to(device=master.device, dtype=master.dtype, non_blocking=True)
        if any(t.device.type == "cuda" for t in self._device.values()):
            torch.cuda.synchronize()  # the non-blocking copies of the gradients are done

    @torch.no_grad()
    def to_device(self, optimizer: torch.optim.Optimizer) -> None:
        """Give every parameter back its device tensor, holding the updated master's values."""
        for p in _params(optimizer):
            device = self._device.pop(id(p), None)
            p.grad = None
            if device is None:  # resting on its master (offload="parameters"): updated in place
                continue
            master = p.data
            p.data = device
            p.data.copy_(master, non_blocking=True)

    def _at_rest(self, p: Tensor) -> bool:
        """``p`` is its host master already (``offload="parameters"`` between schedules)."""
        return p.data_ptr() == self.masters[id(p)].data_ptr()

    @torch.no_grad()
    def state_to_host(self, optimizer: torch.optim.Optimizer) -> None:
        """Move optimizer state tensors next to the masters (``load_state_dict`` puts them on the parameter's
        device)."""
        for p in _params(optimizer):
            state = optimizer.state.get(p)
            if not state:
                continue
            master = self.masters[id(p)]
            for key, value in state.items():
                if isinstance(value, Tensor) and value.device != master.device and value.dim() > 0:
                    state[key] = value.to(master.device)


def _params(optimizer: torch.optim.Optimizer) -> Iterator[Tensor]:
    for group in optimizer.param_groups:
        yield from group["params"]


class ActivationOffload:
    """Saved activations in host memory (``offload="activations"``): what autograd keeps for the backward is
    copied to the host as the forward saves it and copied back when the backward needs it.

        offload = ActivationOffload(device)
        with offload.saving():        # around a stage's forward
            out = stage(x)
        offload.saved_bytes           # what went to the host so far

    Parameters (leaf tensors that require gradients) stay where they are: they are not activations, and the
    weights are on the device anyway. On a GPU the host buffers are pinned and the copies asynchronous.
    """

    def __init__(self, device: torch.device | None) -> None:
        self.pinned = device is not None and device.type == "cuda"
        self.saved_tensors = 0
        self.saved_bytes = 0

    def _pack(self, t: Tensor) -> Any:
        if (t.is_leaf and t.requires_grad) or t.is_meta:  # weights; torch's shape inference on meta tensors
            return t
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=self.pinned)
        host.copy_(t, non_blocking=self.pinned)
        self.saved_tensors += 1
        self.saved_bytes += t.numel() * t.element_size()
        return (t.device, host)

    @staticmethod
    def _unpack(packed: Any) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=host.is_pinned())

    def saving(self) -> Any:
        """Autograd's saved tensors go to the host inside this context."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
