"""Gradient sync across pipelines of mixed depths: each parameter is reduced among exactly its holders.

    sync = CrossPipelineSync(module, split, layout, plans, rank=r, ties=placement.ties)   # collective
    sync.make_equal()        # every copy starts as pipeline 0's (what DDP's first broadcast does)
    sync.reduce(scale)       # each gradient becomes the sum over its holders of scale x their gradient

With pipelines of different depths (``[2, 3]``) the stages have different cuts, so there is no
data-parallel group per stage. A parameter is held by one rank in every pipeline; the ranks that
hold it are a function of its name, the same on every rank, so every rank can build every group
in the same order. Gradients are reduced in flat buckets, one all-reduce per holder group and
bucket. A pipeline running ``m`` of the step's ``M`` micro-batches scales its (micro-batch
averaged) gradients by ``m / M`` before the sum: the result is the mean over all ``M`` micro-batches,
as one process training on the whole global batch gets it, however the batch is split.

A tied parameter (an embedding shared with the output layer) has one copy per stage that uses it;
within a pipeline the copies already hold the pipeline's whole gradient (:class:`TiedCopies`), so
only each pipeline's reference copy contributes and the sum runs over every copy of every pipeline.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

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


def all_holder_sets(
    split: ModelSplit, grid: Layout, plans: Sequence[StagePlan], ties: Sequence[TiedParameter]
) -> list[Holders]:
    """Every holder set of the model (layers, modules before and after them, ties), sorted: the groups to make."""
    sets: set[Holders] = set()
    for layer in range(split.num_layers):
        sets.add(tuple(sorted(grid.rank_of(j, p.rank_of_stage(p.stage_of_layer(layer))) for j, p in enumerate(plans))))
    sets.add(tuple(sorted(grid.rank_of(j, p.rank_of_stage(0)) for j, p in enumerate(plans))))
    sets.add(tuple(sorted(grid.rank_of(j, p.rank_of_stage(p.num_stages - 1)) for j, p in enumerate(plans))))
    sets.update(tie_holders(t, split, grid, plans) for t in ties)
    return sorted(s for s in sets if len(s) > 1)


@dataclass
class _Entry:
    """One tensor of a holder group: this rank's copies of it and whether this rank's gradient counts."""

    key: str
    copies: list[Tensor]
    contributes: bool = True


class CrossPipelineSync:
    """This rank's parameters grouped by their holders, and one process group per holder set."""

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
    ) -> None:
        self.groups: dict[Holders, dist.ProcessGroup] = {}
        for holders in all_holder_sets(split, grid, plans, ties):  # every rank makes every group, in one order
            made = dist.new_group(list(holders))
            if rank in holders:
                self.groups[holders] = made
        self.params: dict[Holders, list[_Entry]] = {}
        self.buffers: dict[Holders, list[_Entry]] = {}
        local = dict(module.named_parameters(remove_duplicate=False))
        tied_names = {n for t in ties for n in t.stages}
        for tie in ties:
            names = [n for n in tie.stages if n in local]
            if not names or not local[names[0]].requires_grad:
                continue
            copies: list[Tensor] = list({id(local[n]): local[n] for n in names}.values())
            entry = _Entry(f"tie:{tie.name}", copies, contributes=tie.name in names)
            self._add(self.params, tie_holders(tie, split, grid, plans), entry)
        for name, p in local.items():
            if name not in tied_names and p.requires_grad:
                self._add(self.params, holders_of(name, split, grid, plans), _Entry(name, [p]))
        for name, b in module.named_buffers():
            self._add(self.buffers, holders_of(name, split, grid, plans), _Entry(name, [b]))
        for entries in (*self.params.values(), *self.buffers.values()):
            entries.sort(key=lambda e: e.key)

    def _add(self, table: dict[Holders, list[_Entry]], holders: Holders | None, entry: _Entry) -> None:
        if holders is not None and holders in self.groups:
            table.setdefault(holders, []).append(entry)

    @torch.no_grad()
    def make_equal(self) -> None:
        """Every holder takes the values of the lowest rank holding the tensor (pipeline 0's copy)."""
        for table in (self.params, self.buffers):
            for holders, entries in table.items():
                for bucket in _buckets([e.copies[0] for e in entries], self.BUCKET_BYTES):
                    flat = _flatten_dense_tensors(bucket)
                    dist.broadcast(flat, src=holders[0], group=self.groups[holders])
                    for t, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                        t.copy_(synced)
        for entries in self.params.values():
            for e in entries:
                for copy in e.copies[1:]:
                    copy.copy_(e.copies[0])

    @torch.no_grad()
    def reduce(self, scale: float) -> None:
        """``grad = sum over holders of scale x grad`` for every parameter (a missing gradient counts as zero)."""
        for holders, entries in self.params.items():
            grads = []
            for e in entries:
                g = e.copies[0].grad
                if g is None or not e.contributes:
                    g = torch.zeros_like(e.copies[0])
                grads.append(g)
            done: list[Tensor] = []
            for bucket in _buckets(grads, self.BUCKET_BYTES):
                flat = _flatten_dense_tensors(bucket)
                if scale != 1.0:
                    flat.mul_(scale)
                dist.all_reduce(flat, group=self.groups[holders])
                done.extend(_unflatten_dense_tensors(flat, bucket))
            for e, g in zip(entries, done):
                for copy in e.copies:
                    copy.grad = g.clone() if len(e.copies) > 1 else g


def _buckets(tensors: list[Tensor], limit: int) -> Iterator[list[Tensor]]:
    """Consecutive runs of tensors of one dtype and device, each up to ``limit`` bytes (or one tensor)."""
    bucket: list[Tensor] = []
    size = 0
    for t in tensors:
        if bucket and (t.dtype != bucket[0].dtype or t.device != bucket[0].device or size >= limit):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += t.numel() * t.element_size()
    if bucket:
        yield bucket
