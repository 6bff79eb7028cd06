"""Parameters tied across pipeline stages, kept as Megatron-LM keeps its embedding group.

    ties = TiedCopies(module, placement.ties, split, plans, grid, pp_rank=1, dp_rank=0)   # collective: makes groups
    ties.make_equal()      # every copy starts as the reference copy (the stage holding the first name)
    ties.sum_grads()       # after backward: each copy's gradient becomes the sum over the copies
    ties.duplicates        # this rank's copies that are not the reference (left out of gradient norms)
    ties.aliases           # {other name: stored name}, for checkpoints

Each stage that uses a tied parameter (an input embedding shared with the output layer) holds a copy.
The copies start equal, their gradients are summed over the ranks that hold them (within one
data-parallel replica, after data-parallel averaging) before clipping and the optimizer step, so they
get the same update and stay equal. Where one rank holds every stage that uses a parameter (one
pipeline stage, or a V-shaped schedule with the first and last stage on one rank) it stays one tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lightning_spot.layout import Layout
from lightning_spot.partition.cuts import StagePlan
from lightning_spot.partition.discovery import ModelSplit
from lightning_spot.partition.placement import TiedParameter, stage_of_parameter
from lightning_spot.utils.distributed import is_initialized


def _stages_of(tie: TiedParameter, split: ModelSplit, plan: StagePlan) -> set[int]:
    """The stages that use ``tie`` when the layers are cut as in ``plan`` (another pipeline's, perhaps)."""
    stages = {stage_of_parameter(name, split, plan) for name in tie.stages}
    return {s for s in stages if s is not None}


@dataclass
class _TieGroup:
    tie: TiedParameter
    #: this rank's copies, one per local stage that uses the parameter; the first is the reference here
    copies: list[nn.Parameter]
    group: dist.ProcessGroup | None
    #: the reference copy's rank within ``group``
    owner: int
    is_owner: bool


class TiedCopies:
    """This rank's copies of tied parameters and the process groups that keep them equal."""

    def __init__(
        self,
        module: nn.Module,
        ties: tuple[TiedParameter, ...],
        split: ModelSplit,
        plans: Sequence[StagePlan],
        grid: Layout,
        *,
        pp_rank: int,
        dp_rank: int,
    ) -> None:
        """``plans``: the stage plan of every pipeline (replica); this rank is ``pp_rank`` in pipeline ``dp_rank``."""
        self.aliases = {alias: tie.name for tie in ties for alias in tie.aliases}
        #: the model's tied parameters (those this rank holds no copy of too)
        self.tied = tuple(ties)
        self._groups: list[_TieGroup] = []
        local = dict(module.named_parameters(remove_duplicate=False))
        plan = plans[dp_rank]
        for tie in ties:
            holders = sorted({plan.rank_of_stage(s) for s in tie.stages.values()})
            owner_pp = plan.rank_of_stage(tie.owner_stage)
            group = None
            if is_initialized():
                for d, other in enumerate(plans):  # every rank creates every group, in the same order
                    ranks = sorted({grid.rank_of(d, other.rank_of_stage(s)) for s in _stages_of(tie, split, other)})
                    if len(ranks) > 1:
                        made = dist.new_group(ranks)
                        if d == dp_rank:
                            group = made
            copies: list[nn.Parameter] = []
            for name in tie.stages:  # the stored name first: on the owner's rank that copy is the reference
                if name in local and all(local[name] is not c for c in copies):
                    copies.append(local[name])
            if copies and (group is not None or len(copies) > 1):
                self._groups.append(_TieGroup(tie, copies, group, holders.index(owner_pp), pp_rank == owner_pp))

    @property
    def copies(self) -> list[nn.Parameter]:
        """Every copy of a tied parameter on this rank (its gradient is whole only after :meth:`sum_grads`)."""
        return [c for g in self._groups for c in g.copies]

    @property
    def duplicates(self) -> list[nn.Parameter]:
        """Copies that are not the reference: their gradient is counted once, with the reference, in norms."""
        out = []
        for g in self._groups:
            out.extend(g.copies[1:] if g.is_owner or g.group is None else g.copies)
        return out

    @torch.no_grad()
    def make_equal(self) -> None:
        """Every copy takes the reference copy's values (collective over each tie group)."""
        for g in self._groups:
            if g.group is not None:
                dist.broadcast(g.copies[0].data, group=g.group, group_src=g.owner)
            for copy in g.copies[1:]:
                copy.data.copy_(g.copies[0].data)

    @torch.no_grad()
    def sum_grads(self, reduce_on: torch.device | None = None) -> None:
        """Each copy's gradient becomes the sum of all copies' gradients (collective over each tie group).
        ``reduce_on``: the device the collective runs on (gradients in host memory under NCCL: the GPU)."""
        for g in self._groups:
            grads = [c.grad for c in g.copies if c.grad is not None]
            total = torch.stack(grads).sum(0) if grads else torch.zeros_like(g.copies[0])
            if g.group is not None:
                where = total.device
                total = total.to(reduce_on or where)
                dist.all_reduce(total, group=g.group)
                total = total.to(where)
            for copy in g.copies:
                if copy.grad is None:
                    copy.grad = total.clone()
                else:
                    copy.grad.copy_(total)
