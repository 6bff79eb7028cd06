"""Pipelines of different depths and cuts in one torchft quorum: each parameter averaged among exactly its holders.

    plans = quorum_plans(replica_ids, split)              # each pipeline's cuts, from its replica id (None: alike)
    reduce = HolderReduce(module, params, split, plans, me=(index, pp_rank), pg=make_pg)   # per quorum
    reduce.reduce(weight, riders)                          # like EarlyBuckets.reduce: .grad = the weighted mean

torchft gives the ranks of stage ``k`` of every pipeline one process group, which assumes every pipeline cuts the
model alike. With other cuts (a pipeline re-formed at another depth, ``[2, 1]`` from the start), a parameter is
held by one rank in every pipeline, and which ranks follows from its name and the pipelines' cuts, the same on
every rank (``runtime.cross_pipeline.holders_of``, as the restart path's mixed depths use it). Each set of holders
gets a process group of its own for the quorum, configured from the quorum's store (``pg(key, rank, size)``); a
rank in several sets (a shallow pipeline's stage spans several of a deep one's) reduces in each. Every holder
contributes its pipeline's weight times its mean gradient, with the weight riding in the bucket: the quorum's
weighted mean per parameter, as one process on the whole batch gets it. The step's logged sums ride with the group
of the pipelines' last stages. A pipeline may run several stages per process (a looped or V-shaped schedule: its
replica id says on how many processes, ``s4p2c1.2.3``). A tied parameter has a copy on every stage that uses it;
after each pipeline summed its copies' gradients, the copies of every pipeline form one group in which each
pipeline's reference copy carries its gradient and weight once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from lightning_spot.layout import Layout, LayoutError
from lightning_spot.partition.cuts import StagePlan, Style
from lightning_spot.partition.discovery import ModelSplit
from lightning_spot.partition.placement import TiedParameter
from lightning_spot.runtime.cross_pipeline import holders_of, local_copies, tie_holders
from lightning_spot.torchft.arrival import GroupAbandoned
from lightning_spot.torchft.early_buckets import weight_tail
from lightning_spot.torchft.running_quorum import parse_replica_id, parse_tag

#: (name of the group, this rank's place in it, its size) -> a configured process group (torchft's, reconfigurable)
GroupFactory = Callable[[str, int, int], Any]


def quorum_plans(replica_ids: Sequence[str], split: ModelSplit) -> list[StagePlan] | None:
    """Each quorum member's stage plan, in the quorum's order; None when they all cut alike
    (torchft's own per-stage groups serve them) or a member's layout cannot be read."""
    tags = []
    for replica in replica_ids:
        parsed = parse_replica_id(replica)
        if parsed is None:
            return None
        tags.append(parsed[1])
    if len(set(tags)) <= 1:
        return None
    plans = [plan_of(tag, split) for tag in tags]
    return None if any(p is None for p in plans) else plans  # type: ignore[return-value]


def plan_of(tag: str, split: ModelSplit) -> StagePlan | None:
    """The stage plan of a pipeline training the layout ``tag`` (``running_quorum.layout_tag``: its stages, cuts and
    the processes they are placed on); None if it cannot be read."""
    parsed = parse_tag(tag)
    if parsed is None or parsed.stages < 1:
        return None
    style: Style = "v" if parsed.style == "v" else "loop"
    return StagePlan(bounds=(0, *parsed.cuts, split.num_layers), pp_size=parsed.ranks, style=style)


@dataclass
class _TiedEntry:
    """One tied parameter on this rank: its copies here, and whether this rank holds its pipeline's reference copy."""

    copies: list[Tensor]
    contributes: bool


class HolderReduce:
    """This rank's trainable parameters grouped by the ranks of the quorum that hold them; one all-reduce (sum)
    per group per step, over a process group of the group's ranks. A tied parameter (GPT-2's embedding and output
    layer) is one group of every rank holding a copy, in which each pipeline's reference copy alone contributes."""

    def __init__(
        self,
        module: nn.Module,
        params: Sequence[Tensor],
        split: ModelSplit,
        plans: Sequence[StagePlan],
        *,
        me: tuple[int, int],
        pg: GroupFactory,
        ties: Sequence[TiedParameter] = (),
        device: torch.device | None = None,
    ) -> None:
        #: where a group without this rank's parameters makes what it sends (the process groups' device)
        self.device = device or torch.device("cpu")
        grid = Layout.of_depths([p.pp_size for p in plans])
        rank = grid.rank_of(*me)
        self.params = list(params)
        wanted = {id(p) for p in self.params}
        local = dict(module.named_parameters(remove_duplicate=False))
        tied_names = {name for tie in ties for name in tie.stages}
        by_ties: dict[tuple[int, ...], list[_TiedEntry]] = {}
        for tie in sorted(ties, key=lambda t: t.name):  # (one order on every holder: by stored name)
            copies, reference = local_copies(tie, local)
            if any(id(c) in wanted for c in copies):
                every_copy = tie_holders(tie, split, grid, plans)
                by_ties.setdefault(every_copy, []).append(_TiedEntry(copies, contributes=reference))
        by_holders: dict[tuple[int, ...], list[Tensor]] = {}
        for name, p in module.named_parameters():
            if id(p) not in wanted or name in tied_names:
                continue
            holders = holders_of(name, split, grid, plans)
            if holders is None or rank not in holders:
                raise LayoutError(
                    f"parameter {name} is not held by one stage of each pipeline (it sits outside the layer "
                    f"sequence and its first and last modules): pipelines of different depths cannot average it"
                )
            by_holders.setdefault(holders, []).append(p)
        last = tuple(sorted(grid.rank_of(i, p.rank_of_stage(p.num_stages - 1)) for i, p in enumerate(plans)))
        self._riders_key = last if rank in last else None
        if self._riders_key is not None:
            by_holders.setdefault(last, [])

        def made(key: str, holders: tuple[int, ...]) -> Any:
            return pg(key, holders.index(rank), len(holders)) if len(holders) > 1 else None

        # (every rank goes through its groups in one order over the quorum: the parameters' by holders, then the
        # ties' by holders; so that ranks sharing several groups never wait on each other crosswise)
        #: (holders, this rank's parameters in them, the group)
        self.groups: list[tuple[tuple[int, ...], list[Tensor], Any]] = [
            (h, by_holders[h], made("-".join(map(str, h)), h)) for h in sorted(by_holders)
        ]
        #: (holders of every copy, this rank's tied parameters among them, the group)
        self.tie_groups: list[tuple[tuple[int, ...], list[_TiedEntry], Any]] = [
            (h, by_ties[h], made("tied-" + "-".join(map(str, h)), h)) for h in sorted(by_ties)
        ]
        self.launched_early = 0  # (nothing goes out during the backward: kept for EarlyBuckets' callers)

    def arm(self, microbatches: int, scale: float | None) -> None:
        """(EarlyBuckets' interface) nothing is sent during the backward."""

    def _allreduce(self, group: Any, flat: Tensor, op: Any = None) -> None:
        from torch.distributed import AllreduceOptions, ReduceOp

        if group is None:
            return
        opts = AllreduceOptions()
        opts.reduceOp = op if op is not None else ReduceOp.SUM  # type: ignore[assignment]
        group.allreduce([flat], opts).wait()

    @torch.no_grad()
    def reduce(self, weight: float, riders: Tensor | None = None) -> float:
        """Every ``.grad`` becomes the weighted mean over its holders (``weight``: what this pipeline's gradient is
        a mean over); ``riders`` (the last stage's logged sums) are summed with the last stages' group. Returns the
        weights' sum."""
        summed = float(weight)
        for holders, params, group in self.groups:
            grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).float() for p in params]
            device = grads[0].device if grads else self.device
            extra = riders if holders == self._riders_key else None
            tail = weight_tail(float(weight), extra, device)
            assert tail is not None  # (a weight is given)
            flat = _flatten_dense_tensors([*grads, tail]) if grads else tail
            count = sum(g.numel() for g in grads)
            if grads:
                flat[:count].mul_(float(weight))
            self._allreduce(group, flat)
            summed = float(flat[count])
            if extra is not None and riders is not None:
                riders.copy_(flat[count + 1 :].view_as(riders))
            if grads and summed > 0:
                means = _unflatten_dense_tensors(flat[:count].div_(summed), grads)
                for p, mean in zip(params, means):
                    p.grad = mean.to(p.dtype)
        for _, entries, group in self.tie_groups:
            summed = self._reduce_tied(entries, group, float(weight))
        return summed

    def _reduce_tied(self, entries: list[_TiedEntry], group: Any, weight: float) -> float:
        """Each tied parameter's copies take the weighted mean of the pipelines' gradients: every copy in a pipeline
        holds the pipeline's whole gradient already (``TiedCopies.sum_grads``), so the reference copy alone carries
        it and the weight; each entry's weights' sum rides after the gradients. Returns the last one."""
        grads = [
            (e.copies[0].grad if e.copies[0].grad is not None and e.contributes else torch.zeros_like(e.copies[0]))
            .float()
            .mul(weight)
            for e in entries
        ]
        weights = torch.tensor([weight if e.contributes else 0.0 for e in entries], device=grads[0].device)
        flat = _flatten_dense_tensors([*grads, weights])
        self._allreduce(group, flat)
        count = sum(g.numel() for g in grads)
        totals = flat[count:].tolist()
        for e, total, summed in zip(entries, totals, _unflatten_dense_tensors(flat[:count], grads)):
            mean = summed.div_(total) if total > 0 else summed
            for copy in e.copies:
                copy.grad = mean.to(copy.dtype).clone() if len(e.copies) > 1 else mean.to(copy.dtype)
        return float(totals[-1])

    @torch.no_grad()
    def allreduce_small(self, t: Tensor, op: Any = None, riders: bool = False) -> None:
        """Sum (or ``op``) ``t`` in place over one rank of every pipeline: with ``riders`` over the last stages'
        group (on the ranks in it), else over each of this rank's groups in turn (each holds one rank of every
        pipeline, so each gives the same result, and every member of a group reduces in it once)."""
        kept = t.clone()
        for holders, _, group in self.groups:
            if riders and holders != self._riders_key:
                continue
            part = kept.clone()
            self._allreduce(group, part, op)
            t.copy_(part)

    def abort(self) -> None:
        """After a step that did not commit: peers still inside an all-reduce with this rank fail now."""
        for _, _, group in [*self.groups, *self.tie_groups]:
            if group is not None:
                try:
                    group.abort()
                except Exception:  # (already broken)
                    pass


class BrokenReduce:
    """The reduction of a quorum whose groups could not be made (a member gone or giving up): every call fails with
    that error, which the step reports (it does not commit, and is run again with the next quorum)."""

    launched_early = 0

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def arm(self, microbatches: int, scale: float | None) -> None:
        """(EarlyBuckets' interface) nothing is sent during the backward."""

    def reduce(self, weight: float, riders: Tensor | None = None) -> float:
        raise GroupAbandoned(f"no groups for this quorum: {self.error}") from self.error

    def allreduce_small(self, t: Tensor, op: Any = None, riders: bool = False) -> None:
        raise GroupAbandoned(f"no groups for this quorum: {self.error}") from self.error

    def abort(self) -> None:
        """Nothing to abort: the groups made were aborted when one failed."""
