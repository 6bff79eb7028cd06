"""Gradient sync across pipelines of mixed depths: each parameter is reduced among exactly its holders.

    sync = CrossPipelineSync(module, split, grid, plans, rank=r, ties=placement.ties)   # collective: makes groups
    sync.make_equal()                  # every copy starts as pipeline 0's (what DDP's first broadcast does)
    sync.start_step(microbatches=3, total=8)      # before the schedule: arm the hooks
    ...                                # the schedule's backward launches each bucket as soon as it is final
    sync.finish_step()                 # after it (and after tied copies are summed): wait, write the sums back

With pipelines of different depths (``[2, 3]``) the stages have different cuts, so there is no
data-parallel group per stage. A parameter is held by one rank in every pipeline; the ranks that
hold it are a function of its name, the same on every rank, so every rank can build every group
in the same order. Gradients are reduced in flat buckets, one all-reduce per holder group and
bucket. A pipeline running ``m`` of the step's ``M`` micro-batches contributes ``m / M`` times its
micro-batch-averaged gradient (what the backward accumulates, each micro-batch's loss being divided by ``m``;
with fp16 their sum, which the schedule divides): the result is the
mean over all ``M`` micro-batches, as one process training on the whole global batch gets it.

**Overlap.** Like DDP, a bucket's all-reduce starts during the backward: a hook counts each parameter's
gradient accumulations, and once every parameter of a bucket has had all ``m`` of this step's
micro-batches, the bucket is copied out and reduced asynchronously while the backward goes on. Buckets
are launched in one order agreed by every rank (holder groups latest layers first, then the parameters in
reverse model order), so ranks that share several groups never wait on each other crosswise. A bucket
whose parameters did not all get gradients (unused parameters) is reduced when the schedule is over.

A tied parameter (an embedding shared with the output layer) has one copy per stage that uses it;
within a pipeline the copies hold the pipeline's whole gradient only after :class:`TiedCopies` sums
them, so ties are reduced after that, and only each pipeline's reference copy contributes; the sum runs
over every copy of every pipeline.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from lightning_spot.layout import Layout
from lightning_spot.partition.cuts import StagePlan
from lightning_spot.partition.discovery import ModelSplit
from lightning_spot.partition.placement import TiedParameter, stage_of_parameter

Holders = tuple[int, ...]


def holders_of(name: str, split: ModelSplit, grid: Layout, plans: Sequence[StagePlan]) -> Holders | None:
    """The ranks holding parameter (or buffer) ``name``, one per pipeline; ``None`` if every stage has it."""
    ranks = []
    for pipeline, plan in enumerate(plans):
        stage = stage_of_parameter(name, split, plan)
        if stage is None:
            return None
        ranks.append(grid.rank_of(pipeline, plan.rank_of_stage(stage)))
    return tuple(sorted(ranks))


def tie_holders(tie: TiedParameter, split: ModelSplit, grid: Layout, plans: Sequence[StagePlan]) -> Holders:
    """Every rank holding a copy of a tied parameter, in any pipeline."""
    ranks: set[int] = set()
    for name in tie.stages:
        ranks.update(holders_of(name, split, grid, plans) or ())
    return tuple(sorted(ranks))


def local_copies(tie: TiedParameter, local: Mapping[str, Tensor]) -> tuple[list[Tensor], bool]:
    """This rank's copies of ``tie`` (``local``: its parameters by every name, ``remove_duplicate=False``), one per
    tensor, and whether it holds the reference copy (the stored name's: its pipeline's gradient counts there)."""
    names = [n for n in tie.stages if n in local]
    return list({id(local[n]): local[n] for n in names}.values()), tie.name in names


def holder_sets(split: ModelSplit, grid: Layout, plans: Sequence[StagePlan]) -> dict[Holders, int]:
    """Every holder set of the layers and of the modules before and after them, with the latest layer it holds
    (-1: before the sequence, ``num_layers``: after it), the key of the launch order."""
    latest: dict[Holders, int] = {}

    def add(holders: Holders, layer: int) -> None:
        latest[holders] = max(latest.get(holders, layer), layer)

    for layer in range(split.num_layers):
        add(
            tuple(sorted(grid.rank_of(j, p.rank_of_stage(p.stage_of_layer(layer))) for j, p in enumerate(plans))), layer
        )
    add(tuple(sorted(grid.rank_of(j, p.rank_of_stage(0)) for j, p in enumerate(plans))), -1)
    add(
        tuple(sorted(grid.rank_of(j, p.rank_of_stage(p.num_stages - 1)) for j, p in enumerate(plans))), split.num_layers
    )
    return latest


@dataclass
class _Entry:
    """One tensor of a holder group: this rank's copies of it and whether this rank's gradient counts."""

    order: int  # position in the model's parameter order (the same on every holder)
    copies: list[Tensor]
    contributes: bool = True


@dataclass
class _Bucket:
    """Consecutive entries of one holder group, reduced by one all-reduce."""

    group: Any
    entries: list[_Entry]
    waiting: int = 0  # parameters whose gradient is not final yet this step
    flat: Tensor | None = None
    work: Any = None
    scale: float = 1.0


class CrossPipelineSync:
    """This rank's parameters grouped by their holders, one process group per holder set, buckets in one order."""

    BUCKET_BYTES = 25 * 2**20

    def __init__(
        self,
        module: nn.Module,
        split: ModelSplit,
        grid: Layout,
        plans: Sequence[StagePlan],
        *,
        rank: int,
        ties: Sequence[TiedParameter] = (),
        overlap: bool = True,
    ) -> None:
        latest = holder_sets(split, grid, plans)
        tie_sets = sorted({tie_holders(t, split, grid, plans) for t in ties})
        self.groups: dict[tuple[str, Holders], Any] = {}
        kinds = [("params", h) for h in sorted(latest)] + [("ties", h) for h in tie_sets]
        for kind, holders in kinds:  # every rank makes every group, in one order
            if len(holders) > 1:
                made = dist.new_group(list(holders))
                if rank in holders:
                    self.groups[(kind, holders)] = made
        order = {name: i for i, (name, _) in enumerate(module.named_parameters(remove_duplicate=False))}
        local = dict(module.named_parameters(remove_duplicate=False))
        tied_names = {n for t in ties for n in t.stages}
        params: dict[Holders, list[_Entry]] = {}
        tied: dict[Holders, list[_Entry]] = {}
        tie_order = sorted(t.name for t in ties)  # ties in one order on every holder: by stored name
        for tie in ties:
            copies, reference = local_copies(tie, local)
            tie_set = tie_holders(tie, split, grid, plans)
            if not copies or not copies[0].requires_grad or ("ties", tie_set) not in self.groups:
                continue
            tied.setdefault(tie_set, []).append(_Entry(tie_order.index(tie.name), copies, reference))
        for name, p in local.items():
            held = holders_of(name, split, grid, plans)
            if name in tied_names or not p.requires_grad or held is None or ("params", held) not in self.groups:
                continue
            params.setdefault(held, []).append(_Entry(order[name], [p]))
        # launch order: groups holding later layers first (backward order), parameters in reverse model order
        self.buckets: list[_Bucket] = []
        for holders in sorted(params, key=lambda h: (-latest[h], h)):
            entries = sorted(params[holders], key=lambda e: -e.order)
            self.buckets += self._bucketed(self.groups[("params", holders)], entries)
        self.tie_buckets: list[_Bucket] = []
        for holders in sorted(tied):
            self.tie_buckets += self._bucketed(
                self.groups[("ties", holders)], sorted(tied[holders], key=lambda e: e.order)
            )
        self.buffers: list[tuple[Any, int, list[Tensor]]] = []
        by_holders: dict[Holders, list[Tensor]] = {}
        for name, b in module.named_buffers():
            held = holders_of(name, split, grid, plans)
            if held is not None and ("params", held) in self.groups:
                by_holders.setdefault(held, []).append(b)
        for holders in sorted(by_holders):
            self.buffers.append((self.groups[("params", holders)], holders[0], by_holders[holders]))
        self._bucket_of: dict[int, _Bucket] = {}
        for bucket in self.buckets:
            for e in bucket.entries:
                self._bucket_of[id(e.copies[0])] = bucket
                if overlap:
                    e.copies[0].register_post_accumulate_grad_hook(self._accumulated)
        self._counts: dict[int, int] = {}
        self._expected = 0
        self._scale = self._finished_scale = 1.0
        self._next = 0
        self._armed = False
        #: buckets launched during the backward, over all steps so far
        self.launched_early = 0

    def _bucketed(self, group: Any, entries: list[_Entry]) -> list[_Bucket]:
        return [
            _Bucket(group, chunk)
            for chunk in tensor_runs(entries, lambda e: e.copies[0], self.BUCKET_BYTES)  # one dtype and device each
        ]

    @torch.no_grad()
    def make_equal(self) -> None:
        """Every holder takes the values of the lowest rank holding the tensor (pipeline 0's copy)."""
        for bucket in [*self.buckets, *self.tie_buckets]:
            tensors = [e.copies[0] for e in bucket.entries]
            self._broadcast(bucket.group, min(dist.get_process_group_ranks(bucket.group)), tensors)
            for e in bucket.entries:
                for copy in e.copies[1:]:
                    copy.copy_(e.copies[0])
        for group, src, tensors in self.buffers:
            for chunk in tensor_runs(tensors, lambda t: t, self.BUCKET_BYTES):
                self._broadcast(group, src, chunk)

    @staticmethod
    def _broadcast(group: Any, src: int, tensors: list[Tensor]) -> None:
        flat = _flatten_dense_tensors([t.detach() for t in tensors])
        dist.broadcast(flat, src=src, group=group)
        for t, synced in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
            t.data.copy_(synced)

    # ------------------------------------------------------------------------------------------- one step
    def start_step(self, microbatches: int, total: int, divided: bool = True) -> None:
        """Before the schedule: this pipeline runs ``microbatches`` of the step's ``total``; ``divided``: each
        micro-batch's loss was divided by ``microbatches`` (else the schedule divides the gradients, fp16)."""
        self._expected = microbatches
        # of the micro-batches' gradients as the hook sees them (their mean, or their sum), and after the schedule
        self._scale = microbatches / total if divided else 1.0 / total
        self._finished_scale = microbatches / total
        self._counts = dict.fromkeys(self._bucket_of, 0)
        for bucket in self.buckets:
            bucket.waiting, bucket.flat, bucket.work = len(bucket.entries), None, None
        self._next = 0
        self._armed = True

    def _accumulated(self, param: Tensor) -> None:
        """A parameter's gradient got one more micro-batch (an autograd hook)."""
        if not self._armed:
            return
        key = id(param)
        self._counts[key] += 1
        if self._counts[key] == self._expected:
            self._bucket_of[key].waiting -= 1
            while self._next < len(self.buckets) and self.buckets[self._next].waiting == 0:
                self._launch(self.buckets[self._next], self._scale, early=True)
                self._next += 1

    @torch.no_grad()
    def _launch(self, bucket: _Bucket, scale: float, early: bool) -> None:
        grads = [
            e.copies[0].grad if e.copies[0].grad is not None else torch.zeros_like(e.copies[0]) for e in bucket.entries
        ]
        bucket.flat = _flatten_dense_tensors(grads)
        if scale != 1.0:
            bucket.flat.mul_(scale)
        bucket.work = dist.all_reduce(bucket.flat, group=bucket.group, async_op=True)
        self.launched_early += int(early)

    @torch.no_grad()
    def finish_step(self) -> None:
        """After the schedule (whose gradients are the mean over its micro-batches) and the sum of tied copies:
        launch what the backward did not, wait for everything, and put each sum in ``.grad``."""
        self._armed = False
        while self._next < len(self.buckets):  # the rest, in the agreed order
            self._launch(self.buckets[self._next], self._finished_scale, early=False)
            self._next += 1
        for bucket in self.tie_buckets:
            grads = [
                e.copies[0].grad if e.copies[0].grad is not None and e.contributes else torch.zeros_like(e.copies[0])
                for e in bucket.entries
            ]
            bucket.flat = _flatten_dense_tensors(grads).mul_(self._finished_scale)
            bucket.work = dist.all_reduce(bucket.flat, group=bucket.group, async_op=True)
        for bucket in [*self.buckets, *self.tie_buckets]:
            bucket.work.wait()
            tensors = [e.copies[0] for e in bucket.entries]
            for e, g in zip(bucket.entries, _unflatten_dense_tensors(bucket.flat, tensors)):
                for copy in e.copies:
                    copy.grad = g.clone() if len(e.copies) > 1 else g
            bucket.flat = bucket.work = None


def tensor_runs(items: list[Any], tensor_of: Any, limit: int) -> Iterator[list[Any]]:
    """Consecutive runs of items whose tensors share dtype and device, each up to ``limit`` bytes (or one item)."""
    chunk: list[Any] = []
    size = 0
    for item in items:
        t = tensor_of(item)
        if chunk and (t.dtype != tensor_of(chunk[0]).dtype or t.device != tensor_of(chunk[0]).device or size >= limit):
            yield chunk
            chunk, size = [], 0
        chunk.append(item)
        size += t.numel() * t.element_size()
    if chunk:
        yield chunk


def mixed_groups(grid: Layout, rank: int) -> tuple[Any, Any]:
    """(this rank's pipeline group, the group of every pipeline's last stage if this rank holds one) for pipelines
    of mixed depths. Collective: every rank makes every group, in the same order."""
    pp_group = last_group = None
    for pipeline in range(grid.data_parallel):
        ranks = grid.pipeline_ranks(pipeline)
        made = dist.new_group(ranks)
        if rank in ranks:
            pp_group = made
    lasts = [grid.pipeline_ranks(p)[-1] for p in range(grid.data_parallel)]
    made = dist.new_group(lasts)
    if rank in lasts:
        last_group = made
    return pp_group, last_group
