"""A stage's gradients sent to the other pipelines while its backward still runs, as DDP overlaps its buckets.

    buckets = EarlyBuckets(params, tied=ties.copies, allreduce=manager_allreduce)   # during_backward=False: after
    buckets.arm(microbatches=4, scale=1.5)   # before the schedule; scale=None: nothing goes out early this step
    ...                                      # the backward: a bucket whose parameters all have their m gradients goes
    buckets.reduce(weight)                   # after the step: the rest goes out, everything is waited for, and
                                             # every .grad becomes the weighted mean over the quorum's pipelines

Every pipeline cuts the model the same way, so this rank's buckets (fixed at construction, in reverse parameter
order, a fixed byte size each) are the same tensors on stage k of every pipeline, and every pipeline launches them
in the same order: bucket 0, 1, ..., the last one with the weight. A bucket goes out early, during the backward, when all its
parameters have accumulated the step's ``m`` micro-batch gradients (a post-accumulate-grad hook counts them; each
micro-batch's loss was divided by ``m``); it then carries ``scale`` times that sum, which the caller chooses so
that it equals ``weight`` times this pipeline's final gradient (``samples`` for a loss averaged over samples,
``r x m`` for losses weighted by their items, ``r`` being their reference count). A bucket that is not complete
during the backward (unused parameters, tied copies — whose gradient
is only whole after the pipeline summed its copies — or a step whose scale is not known yet, such as the first)
carries ``weight`` times the final ``.grad`` instead, as the last bucket always does. Either way each pipeline
contributes ``weight x its mean gradient``; the weights' sum rides in the last bucket, as one more number, and the
sum divided by it is the quorum's mean.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from lightning_spot.runtime.cross_pipeline import tensor_runs

#: bytes per bucket: several buckets per stage of a large model, so that the first ones overlap the backward
BUCKET_BYTES = 8 * 2**20


@dataclass
class _Bucket:
    params: list[Tensor]
    early: bool  # may go out during the backward (no tied copies)
    waiting: int = 0
    flat: Tensor | None = None
    work: Any = None
    counts: dict[int, int] = field(default_factory=dict)


class EarlyBuckets:
    """This rank's trainable parameters in buckets, each all-reduced (sum) over the quorum once per step."""

    def __init__(
        self,
        params: Sequence[Tensor],
        *,
        tied: Sequence[Tensor] = (),
        allreduce: Callable[[Tensor], Any],
        bucket_bytes: int | None = None,
        during_backward: bool = True,
        device: torch.device | None = None,
    ) -> None:
        self._allreduce = allreduce
        #: where a stage without trainable parameters makes what it sends (the process group's device)
        self.device = device or torch.device("cpu")
        self.params = list(params)
        tied_ids = {id(p) for p in tied}
        ordered = list(reversed(params))  # the backward reaches the last parameters first
        chunks = list(tensor_runs(ordered, lambda p: p, bucket_bytes or BUCKET_BYTES))
        # the last bucket always goes after the step, with the weight: what the all-reduces carry must not depend
        # on which buckets went out early (each pipeline's choice, and not on a joiner's first step); the backward
        # finishes that bucket last, so little overlap is lost
        self.buckets = [
            _Bucket(chunk, early=during_backward and i < len(chunks) - 1 and not any(id(p) in tied_ids for p in chunk))
            for i, chunk in enumerate(chunks)
        ]
        self._bucket_of: dict[int, _Bucket] = {}
        for bucket in self.buckets:
            for p in bucket.params:
                self._bucket_of[id(p)] = bucket
                if bucket.early:
                    p.register_post_accumulate_grad_hook(self._accumulated)
        self._expected = 0
        self._scale: float | None = None
        self._next = 0
        #: buckets that went out during a backward, over the run (how much of the reduction overlapped)
        self.launched_early = 0

    def arm(self, microbatches: int, scale: float | None) -> None:
        """Before a step's schedule: each parameter gets ``microbatches`` gradients; an early bucket carries
        ``scale`` times their sum (``None``: no bucket goes out before :meth:`reduce`)."""
        self._expected, self._scale, self._next = microbatches, scale, 0
        for bucket in self.buckets:
            bucket.flat, bucket.work = None, None
            if scale is not None:  # (counted only when buckets may go out early)
                bucket.waiting = len(bucket.params)
                bucket.counts = dict.fromkeys((id(p) for p in bucket.params), 0)

    def _accumulated(self, param: Tensor) -> None:
        if self._scale is None:
            return
        bucket = self._bucket_of[id(param)]
        bucket.counts[id(param)] += 1
        if bucket.counts[id(param)] != self._expected:
            return
        bucket.waiting -= 1
        while self._next < len(self.buckets):  # in the agreed order: a later bucket waits for the earlier ones
            nxt = self.buckets[self._next]
            if not nxt.early or nxt.waiting:
                break
            self._launch(nxt, self._scale)
            self._next += 1
            self.launched_early += 1

    @torch.no_grad()
    def _launch(self, bucket: _Bucket, scale: float, weight: float | None = None, riders: Tensor | None = None) -> None:
        """Send ``scale`` times the bucket's gradients; with ``weight``, that number rides along as one more
        element (the weights' sum then needs no all-reduce of its own), and ``riders`` after it."""
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).float() for p in bucket.params]
        tail = weight_tail(weight, riders, grads[0].device if grads else self.device)
        if tail is not None:
            grads.append(tail)
        # (out of place: a bucket of one tensor flattens to a view of its .grad, which the step changes afterwards)
        bucket.flat = _flatten_dense_tensors(grads).mul(scale)
        if tail is not None:
            bucket.flat[-tail.numel() :] = tail
        bucket.work = self._allreduce(bucket.flat)

    @torch.no_grad()
    def reduce(self, weight: float, riders: Tensor | None = None) -> float:
        """After the step (``.grad`` final, ``weight`` what it is a mean over): send what has not gone out, wait
        for every bucket, and set ``.grad`` to the weighted mean over the quorum. Returns the weights' sum.

        ``riders``: numbers summed over the quorum in the same round trip (the step's logged sums), in place."""
        self._scale = None  # (no more early launches until the next arm)
        extra = riders.numel() if riders is not None else 0
        for bucket in self.buckets[self._next :]:  # the last one carries the weight (one round trip fewer)
            if bucket is self.buckets[-1]:
                self._launch(bucket, weight, float(weight), riders)
            else:
                self._launch(bucket, weight)
        self._next = len(self.buckets)
        if self.buckets:
            last = self.buckets[-1]
            last.work.wait()
            assert last.flat is not None
            tail = last.flat[-1 - extra :]
        else:  # a stage without trainable parameters
            alone = weight_tail(float(weight), riders, self.device)
            assert alone is not None
            self._allreduce(alone).wait()
            tail = alone
        summed = float(tail[0])
        if riders is not None:
            riders.copy_(tail[1:].view_as(riders))
        for bucket in self.buckets:
            bucket.work.wait()
            assert bucket.flat is not None
            if summed > 0:
                grads = bucket.flat[: -1 - extra] if bucket is self.buckets[-1] else bucket.flat  # (less the tail)
                means = _unflatten_dense_tensors(grads.div_(summed), bucket.params)
                for p, mean in zip(bucket.params, means):
                    p.grad = mean.to(p.dtype)
            bucket.flat = bucket.work = None
        return summed


def weight_tail(weight: float | None, riders: Tensor | None, device: torch.device) -> Tensor | None:
    """What the last bucket carries after the gradients: the weight, then the riders."""
    if weight is None:
        return None
    parts = [torch.tensor([weight], device=device)]
    if riders is not None:
        parts.append(riders.detach().float().flatten().to(device))
    return torch.cat(parts)
