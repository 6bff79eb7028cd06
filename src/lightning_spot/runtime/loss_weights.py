"""Combine a step's micro-batch losses the way one process computes the loss of the whole global batch.

    weights = LossWeights()
    weights.start()                                        # before the schedule
    loss = weights.add(loss, count, samples)               # each micro-batch (last stage): what is back-propagated
    records = weights.records()                            # after it (last stage): sums, reduced over replicas
    value, factor = weights.settle(logged, total=8)        # every rank, from the shared sums

Without item counts every micro-batch's loss counts the same (micro-batches hold equal numbers of
samples): the schedule's mean over micro-batches and the data-parallel mean give the mean gradient.

With counts (a loss ``l_i`` that is a mean over ``n_i`` items, e.g. the tokens whose label is not -100),
micro-batch ``i`` back-propagates ``l_i * n_i / r`` and the step's gradients are multiplied by
``r / (N / M)`` afterwards, ``N`` being the items of all ``M`` micro-batches of all replicas (and pipelines
of mixed depths). The result is ``Σ n_i ∇l_i / N``: the gradient of the mean over the global batch's items,
which is what single-process training computes. Any reference count ``r`` gives the same math; the previous
step's items per micro-batch keeps what is back-propagated near the size of a mean, and when every
micro-batch holds as many items as the last step's did (sequences without padding), both multipliers are
exactly 1 and the arithmetic is that of unweighted losses. In the first step, ``r`` is the largest count of
the first micro-batches of all last stages (one all-reduce over ``group``, once).

A loss that is a sum over its micro-batch's samples (``reduction="sum"``) combines as a sum: the step's loss is
``Σ l_i`` over every micro-batch of every replica, and its gradients (each micro-batch's loss divided by the
step's ``T`` micro-batches, and averaged over replicas, as for means) are multiplied by ``T``: ``Σ ∇l_i``, what
one process computes for the sum over the global batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_spot.partition.discovery import ModelContractError
from lightning_spot.runtime.logging_bridge import LogRecord

_SUM = {"reduce_fx": "sum"}
LOSS, ITEMS, WEIGHTED, REFERENCE, SUMMED = "__loss__", "__items__", "__weighted__", "__reference__", "__summed__"
_NAMES = (LOSS, ITEMS, WEIGHTED, REFERENCE, SUMMED)


class LossWeights:
    """One step's micro-batch losses with their weights, and the reference count of the item-weighted path."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        #: the reference count ``r``: the previous step's items per micro-batch (the same on every rank)
        self.reference: float | None = None
        self.use_group(group)
        #: each micro-batch's (loss, item count, samples, whether the loss is a sum over the samples)
        self._parts: list[tuple[Tensor, Tensor | None, int, bool]] = []
        #: what the last step's gradient is a mean over: its samples, or its items when losses came with counts
        self.items = 0.0

    def use_group(self, group: dist.ProcessGroup | None) -> None:
        """The last stages of all pipelines, on a rank holding one (``None``: one pipeline)."""
        #: where the first reference is agreed
        self.group = group
        #: whether this rank is the first of ``group`` (or there is none): the one that adds the reference to the sums
        self.leads = group is None or dist.get_rank(group) == 0

    def start(self) -> None:
        self._parts = []

    def add(self, loss: Tensor, count: Tensor | None, samples: int, summed: bool = False) -> Tensor:
        """Record one micro-batch's loss (``count``: the items it is a mean over, if known; ``summed``: a sum over its
        samples); return what the schedule back-propagates for it."""
        if summed and count is not None:
            raise ModelContractError(
                "training_step declared both an item count (`num_items`) and a loss summed over samples: a count "
                "belongs to a mean. Return the one that describes the loss."
            )
        self._parts.append((loss.detach().float(), count, samples, summed))
        if count is None:
            return loss
        if self.reference is None:
            self.reference = self._first_reference(count)
        return loss * (count.to(device=loss.device, dtype=torch.float32) / self.reference)

    def _first_reference(self, count: Tensor) -> float:
        """The first count seen, the largest over the last stages of all pipelines (1 if it is 0)."""
        value = count.detach().float().reshape(1).clone()
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return float(value) or 1.0

    def records(self) -> list[LogRecord]:
        """The sums this rank contributes: the weighted losses, their weights, the micro-batches with counts."""
        parts = self._parts
        with_counts = sum(count is not None for _, count, _, _ in parts)
        _check_all_or_none(with_counts, len(parts), "gave an item count for their loss", "Return `num_items`")
        summed = sum(s for *_, s in parts)
        _check_all_or_none(summed, len(parts), "returned a loss summed over samples", "Return such a loss")
        if not parts:
            zero = torch.zeros(())
            return [LogRecord(name, zero, 1.0, _SUM) for name in _NAMES]
        if with_counts:
            counts = [count.float().to(loss.device) for loss, count, _, _ in parts if count is not None]
            # a micro-batch without items has a NaN mean (0 / 0) and adds nothing
            total = torch.stack([torch.where(n > 0, part[0] * n, 0.0) for part, n in zip(parts, counts)]).sum()
            items = torch.stack(counts).sum()
        else:  # (a sum over samples adds up as it is)
            total = torch.stack([loss if summed else loss * samples for loss, _, samples, _ in parts]).sum()
            items = torch.full((), float(sum(samples for _, _, samples, _ in parts)), device=total.device)
        # (fills: a copy of a number to a GPU, as torch.tensor(number, device=...) makes, waits for the device)
        return [
            LogRecord(LOSS, total, 1.0, _SUM),
            LogRecord(ITEMS, items, 1.0, _SUM),
            LogRecord(WEIGHTED, torch.full((), float(with_counts), device=total.device), 1.0, _SUM),
            LogRecord(REFERENCE, torch.full((), self._reference_share(), device=total.device), 1.0, _SUM),
            LogRecord(SUMMED, torch.full((), float(summed), device=total.device), 1.0, _SUM),
        ]

    def _reference_share(self) -> float:
        """What this rank adds to the summed reference: every last stage holds the same one, so only the first of
        ``group`` gives it (a sum travels with the others; a maximum would take an all-reduce of its own)."""
        return (self.reference or 0.0) if self.leads else 0.0

    def settle(self, logged: dict[str, tuple[float, dict]], total: int) -> tuple[float, float]:
        """(the step's loss, the factor for its gradients) from the reduced sums, which are removed from
        ``logged``; the same on every rank. ``total``: the step's micro-batches over all replicas."""
        loss_sum, items, weighted, reference, summed = (logged.pop(name)[0] for name in _NAMES)
        self.items = float(items)
        _check_all_or_none(round(summed), total, "returned a loss summed over samples", "Return such a loss")
        if summed:
            return loss_sum, float(total)
        if weighted == 0:
            return loss_sum / items, 1.0
        _check_all_or_none(round(weighted), total, "gave an item count for their loss", "Return `num_items`")
        if items <= 0:  # nothing to learn from: no gradient (one process would get NaN)
            return float("nan"), 0.0
        per_microbatch = items / total
        factor, self.reference = reference / per_microbatch, per_microbatch  # (what the last stages used)
        return loss_sum / items, factor


def _check_all_or_none(some: int, total: int, what: str, fix: str) -> None:
    """Every micro-batch of a step, or none, must have returned a loss of one kind (``what``)."""
    if 0 < some < total:
        raise ModelContractError(
            f"{some} of this step's {total} micro-batches {what} and the others did not. {fix} from every training "
            f"step (or from none)."
        )
