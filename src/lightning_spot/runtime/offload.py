"""Training state in host memory: the optimizer's (``offload="optimizer"``) and saved activations (``"activations"``).

    offload = OptimizerOffload(optimizers)   # fp32 host copies of every parameter the optimizers update
    offload.copy_out(stage.parameters())     # a stage's backward is over: its gradients start for the host
    offload.to_host(optimizer)               # after backward: each parameter *is* its host master, with its grad
    optimizer.step()                         # the update, and the state it creates, run in host memory
    offload.to_device(optimizer)             # the updated weights copied back; the device keeps no optimizer state

The parameters keep their identity: during the update each one's ``.data`` is swapped for its host master
(fp32, pinned when the device is a GPU) and its gradient for a host copy. The optimizer, unchanged, creates its
state next to the master (``zeros_like``), so Adam's moments never take device memory, and checkpoints, which
map optimizer state to parameter names by identity, read it where it lives. With bf16 weights on the device
the masters keep fp32 precision (the update is computed in fp32 and rounded once when copied back).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Union

import torch
from torch import Tensor

from lightning_spot.layout import LayoutError
from lightning_spot.runtime.last_order import LastOrder

OFFLOAD_LEVELS = ("optimizer", "parameters", "activations")


def offload_levels(offload: Union[str, Sequence[str], None]) -> Union[tuple[str, ...], str]:
    """Check ``offload=`` early: one level or several (``["optimizer", "activations"]``), or ``"auto"`` (the
    planner decides). ``"parameters"`` implies ``"optimizer"``: weights that rest in host memory are updated there."""
    if offload is None:
        return ()
    if offload == "auto":
        return "auto"
    levels = [offload] if isinstance(offload, str) else list(offload)
    for level in levels:
        if level not in OFFLOAD_LEVELS:
            raise LayoutError(
                f"offload={level!r} is not an offload level. Use 'optimizer', 'parameters', 'activations', several "
                f"as a list, 'auto' (the planner decides), or None (no offload)."
            )
    if "parameters" in levels:
        levels.append("optimizer")
    return tuple(sorted(set(levels), key=OFFLOAD_LEVELS.index))


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
        #: gradients copied out once their stage's backward was over: id(p) -> (gradient, its version, host copy)
        self._early: dict[int, tuple[Tensor, int, Tensor]] = {}
        self._buffers: dict[int, Tensor] = {}
        self._stream: torch.cuda.Stream | None = None
        #: gradients the update took from those early copies (the rest were copied when the update began)
        self.early_copies_used = 0
        #: the optimizers (class names) switched to torch's fused kernel for the host update
        self.fused = [type(opt).__name__ for opt in optimizers if _use_fused_kernel(opt, host)]

    @torch.no_grad()
    def copy_out(self, params: Iterable[Tensor]) -> None:
        """Start copying the gradients of ``params`` (final for this step: their stage's backward is over) to the
        host; on a GPU on a side stream, overlapping with the rest of the schedule. :meth:`to_host` uses a copy
        when the gradient is still the same tensor with the same values (version) by then."""
        for p in params:
            grad = p.grad
            if id(p) not in self.masters or grad is None or self._at_rest(p):
                continue
            buffer = self._buffers.get(id(p))
            if buffer is None or buffer.dtype != grad.dtype:
                buffer = torch.empty(grad.shape, dtype=grad.dtype, device=self.host, pin_memory=grad.is_cuda)
                self._buffers[id(p)] = buffer
            if grad.is_cuda:
                if self._stream is None:
                    self._stream = torch.cuda.Stream(grad.device)
                self._stream.wait_stream(torch.cuda.current_stream(grad.device))
                with torch.cuda.stream(self._stream):
                    buffer.copy_(grad, non_blocking=True)
                grad.record_stream(self._stream)
            else:
                buffer.copy_(grad)
            self._early[id(p)] = (grad, grad._version, buffer)

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
            early = self._early.pop(id(p), None)
            if grad is not None and early is not None and early[0] is grad and grad._version == early[1]:
                p.grad = early[2] if early[2].dtype == master.dtype else early[2].to(master.dtype)
                self.early_copies_used += 1
            elif grad is not None:
                p.grad = grad.to(device=master.device, dtype=master.dtype, non_blocking=True)
        self._early.clear()
        if any(t.device.type == "cuda" for t in self._device.values()):
            torch.cuda.synchronize()  # the non-blocking copies of the gradients (either stream) are done

    @contextmanager
    def updating(self, optimizer: Any, closure: Callable[[], Any]) -> Iterator[Callable[[], Any]]:
        """Around one ``optimizer.step(closure)``: the closure handed back runs the step's closure, then makes the
        parameters their host masters (the update and clipping run there); afterwards they are device tensors
        again, holding the updated values. ``optimizer`` may be Lightning's wrapper."""
        target = getattr(optimizer, "_optimizer", optimizer)

        def on_host() -> Any:
            result = closure()
            self.to_host(target)
            return result

        try:
            yield on_host
        finally:
            self.to_device(target)

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


def _use_fused_kernel(optimizer: torch.optim.Optimizer, host: torch.device) -> bool:
    """Adam and AdamW left at their defaults (neither ``fused`` nor ``foreach`` chosen) run the update on the host
    with torch's fused kernel: one pass over each tensor instead of a chain of element-wise ops."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or host.type != "cpu":
        return False
    groups = optimizer.param_groups
    if any(g.get("fused") is not None or g.get("foreach") is not None for g in groups):
        return False
    if any(g.get("differentiable") or g.get("capturable") for g in groups):
        return False
    for group in groups:
        group["fused"] = True
    optimizer.defaults["fused"] = True
    return True


def _params(optimizer: torch.optim.Optimizer) -> Iterator[Tensor]:
    for group in optimizer.param_groups:
        yield from group["params"]


def _is_weight(t: Tensor) -> bool:
    """A leaf that requires grad (a parameter, a stage's input), or a view of one (``weight.t()`` for a matmul)."""
    base = t._base if t._base is not None else t
    return base.is_leaf and base.requires_grad


class _Saved:
    """One tensor autograd saved, in host memory; ``fetched``: its device copy once prefetched."""

    __slots__ = ("device", "fetched", "host")

    def __init__(self, device: torch.device, host: Tensor) -> None:
        self.device = device
        self.host = host
        self.fetched: Tensor | None = None


class ActivationOffload:
    """Saved activations in host memory (``offload="activations"``): what autograd keeps for the backward is
    copied to the host as the forward saves it and brought back, ahead of the backward that needs it.

        offload = ActivationOffload(device)
        offload.new_step()            # each training step: the backward order of the last one drives the prefetch
        offload.key = (stage, chunk)  # what the forward saves from here on is filed under this key
        with offload.saving():        # around a stage's forward
            out = stage(x)
        offload.prefetch((stage, chunk))   # as that chunk's backward starts: its tensors and the next chunk's
        offload.saved_bytes           # what went to the host so far

    Parameters (leaf tensors that require gradients) and views of them (``weight.t()``, which a matmul saves)
    stay where they are: they are not activations, and the weights are on the device anyway. On a GPU the host
    buffers are pinned and the copies asynchronous: the copies back run on a side stream, one chunk ahead, so
    they overlap with the previous chunk's backward.
    """

    def __init__(self, device: torch.device | None) -> None:
        self.pinned = device is not None and device.type == "cuda"
        self.saved_tensors = 0
        self.saved_bytes = 0
        #: tensors brought back ahead of their backward, and those the backward found there
        self.prefetched = 0
        self.prefetch_hits = 0
        self.key: Hashable = None
        self._by_key: dict[Hashable, list[_Saved]] = {}
        self._order = LastOrder()
        self._ready: dict[int, torch.cuda.Event] = {}
        self._stream = torch.cuda.Stream(device) if self.pinned and device is not None else None

    def _pack(self, t: Tensor) -> Any:
        if _is_weight(t) or t.is_meta:  # weights (the device holds them anyway); shape inference's meta tensors
            return t
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=self.pinned)
        host.copy_(t, non_blocking=self.pinned)
        self.saved_tensors += 1
        self.saved_bytes += t.numel() * t.element_size()
        saved = _Saved(t.device, host)
        if self.key is not None:
            self._by_key.setdefault(self.key, []).append(saved)
        return saved

    def _unpack(self, packed: Any) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        fetched, packed.fetched = packed.fetched, None
        if fetched is None:
            return packed.host.to(packed.device, non_blocking=packed.host.is_pinned())
        self.prefetch_hits += 1
        ready = self._ready.get(id(packed))
        if ready is not None:
            torch.cuda.current_stream(fetched.device).wait_event(ready)
            del self._ready[id(packed)]
        return fetched

    def saving(self) -> Any:
        """Autograd's saved tensors go to the host inside this context."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def new_step(self) -> None:
        """A training step starts: the order in which the last one's backward asked for chunks is the guess."""
        self._order.end()
        self._order.begin("train")
        self._by_key.clear()
        self.key = None

    def prefetch(self, key: Hashable) -> None:
        """``key``'s backward starts: bring its tensors back (if not yet on their way) and start on the next
        chunk's, as the last step's backward ordered them."""
        self._fetch(key)
        upcoming = self._order.next_after(key)
        if upcoming is not None:
            self._fetch(upcoming)

    @torch.no_grad()
    def _fetch(self, key: Hashable) -> None:
        pending = self._by_key.pop(key, [])
        if not pending:
            return
        stream = self._stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(pending[0].device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for saved in pending:
                saved.fetched = saved.host.to(saved.device, non_blocking=self.pinned)
        if stream is not None:
            event = stream.record_event()
            for saved in pending:
                assert saved.fetched is not None
                saved.fetched.record_stream(torch.cuda.current_stream(saved.device))
                self._ready[id(saved)] = event
        self.prefetched += len(pending)
