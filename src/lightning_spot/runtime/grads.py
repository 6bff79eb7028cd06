"""Gradient bookkeeping around a pipeline step: stash, data-parallel all-reduce, global-norm clipping.

Lightning's automatic optimisation runs ``training_step`` (where the whole pipeline schedule,
forward *and* backward, runs), then ``zero_grad``, then ``backward``. The schedule's gradients are
therefore taken aside after the step and added back in ``backward``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

Grads = list[Tensor | None]


def take_grads(params: Sequence[Tensor]) -> Grads:
    """Detach the current ``.grad`` of every parameter, leaving ``None`` behind."""
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    return grads


def put_grads(params: Sequence[Tensor], grads: Grads) -> None:
    """Set ``.grad`` back to what :func:`take_grads` returned."""
    for p, g in zip(params, grads):
        p.grad = g


def add_grads(params: Sequence[Tensor], grads: Grads, scale: float = 1.0) -> None:
    """``p.grad += scale * g`` (or ``p.grad = scale * g`` where there is no gradient yet)."""
    for p, g in zip(params, grads):
        if g is None:
            continue
        if scale != 1.0:
            g = g * scale
        if p.grad is None:
            p.grad = g
        else:
            p.grad.add_(g)


def all_reduce_mean(params: Sequence[Tensor], group: dist.ProcessGroup, bucket_bytes: int = 25 * 2**20) -> None:
    """Average ``.grad`` over ``group`` in flattened buckets (for schedules whose backward bypasses DDP)."""
    size = dist.get_world_size(group)
    if size == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    buckets: dict[tuple[torch.dtype, torch.device], list[list[Tensor]]] = {}
    for g in grads:
        key = (g.dtype, g.device)
        lists = buckets.setdefault(key, [[]])
        if lists[-1] and sum(t.numel() * t.element_size() for t in lists[-1]) >= bucket_bytes:
            lists.append([])
        lists[-1].append(g)
    for lists in buckets.values():
        for bucket in lists:
            flat = _flatten_dense_tensors(bucket)
            dist.all_reduce(flat, group=group)
            flat.div_(size)
            for g, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                g.copy_(synced)


@dataclass(frozen=True)
class NormScope:
    """Where a gradient norm over all stages is combined: ``group``, and whether this rank's gradients count
    (``counts``) besides the ``duplicates`` (copies of tied parameters counted on another rank)."""

    group: dist.ProcessGroup | None
    counts: bool
    duplicates: Sequence[Tensor]


def norm_scope(
    mixed: bool, pp_group: dist.ProcessGroup | None, dp_rank: int, duplicates: Sequence[Tensor]
) -> NormScope:
    """The pipeline group, or the world with only pipeline 0 counting where pipelines of ``mixed`` depths cut the
    model differently (data-parallel replicas hold the same, already averaged, gradients)."""
    group = dist.group.WORLD if mixed and dist.is_initialized() else pp_group
    return NormScope(group, counts=dp_rank == 0 or not mixed, duplicates=duplicates)


def global_norm_clipping(scope: NormScope, reduce_on: torch.device) -> Callable[[Any, float], None]:
    """Lightning's ``clip_grad_by_norm(optimizer, clip_val)`` by the norm over all stages (:func:`clip_grad_norm_global`)
    instead of each rank's local norm."""

    def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
        params = [p for param_group in optimizer.param_groups for p in param_group["params"]]
        clip_grad_norm_global(
            params, float(clip_val), scope.group, duplicates=scope.duplicates, counts=scope.counts, reduce_on=reduce_on
        )

    return clip_grad_by_norm


def clip_grad_norm_global(
    params: Sequence[Tensor],
    max_norm: float,
    group: dist.ProcessGroup | None,
    norm_type: float = 2.0,
    duplicates: Sequence[Tensor] = (),
    counts: bool = True,
    reduce_on: torch.device | None = None,
) -> Tensor:
    """Clip by the norm over *all* pipeline stages: the local norms are combined over ``group``.

    Data-parallel replicas hold identical (already averaged) gradients, so ``group`` is the
    pipeline group of this rank; every rank gets the same total norm and clip coefficient.
    ``duplicates`` (copies of tied parameters counted on another rank) are clipped, not counted.
    Pipelines of mixed depths cut the model differently, and summing in another order could give
    each pipeline a slightly different norm: there ``group`` is the whole world and only the ranks of
    pipeline 0 count (``counts``), so that every rank gets the very same coefficient.
    ``reduce_on``: the device the collective runs on (gradients in host memory under NCCL: the GPU).
    """
    grads = [p.grad for p in params if p.grad is not None]
    skip = {id(p) for p in duplicates}
    counted = [p.grad for p in params if p.grad is not None and id(p) not in skip and counts]
    device = grads[0].device if grads else torch.device("cpu")
    if math.isinf(norm_type):
        local = (
            torch.stack([g.detach().abs().max().float() for g in counted]).max()
            if counted
            else torch.zeros((), device=device)
        )
        total = local.clone().to(reduce_on or device)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        total = total.to(device)
    else:
        local = (
            torch.stack([g.detach().float().norm(norm_type) ** norm_type for g in counted]).sum()
            if counted
            else torch.zeros((), device=device)
        )
        total = local.clone().to(reduce_on or device)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
        total = total.to(device) ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total
