"""How many items (tokens) a micro-batch's loss is a mean over: declared by the step, or known from transformers.

    counts = ItemCounts(module)                      # hooks on the transformers models inside ``module``
    with counts.micro_batch(watch=True):
        result = module.training_step(micro_batch)   # may return {"loss": loss, "num_items": n}
    count = counts.count_of(result, loss)            # a tensor, or None: the loss counts like any other

A loss that is a mean over the items of its micro-batch (the tokens whose label is not -100) must be
combined over micro-batches and replicas as a sum over items divided by the items of the global batch
(:mod:`lightning_spot.runtime.loss_weights`). The count comes from

* the step itself: ``return {"loss": loss, "num_items": count}`` (plain Lightning ignores the extra key);
* a transformers model called with ``labels=``: the items the loss function it calls averages over
  (:mod:`lightning_spot.runtime.transformers_losses`; causal LM, ``GPT2LMHeadModel`` included: the labels after
  the first position, masked LM and token classification: every label, sequence classification: one per sample),
  when the step returns that model's loss itself.

With ``watch``, cross-entropy and NLL losses averaged over targets that hold their ``ignore_index`` are
noticed, so that a loss averaged over a varying count that nobody declared can be warned about: as a flag on the
targets' device (reading it would make the host wait for the device; the step runner reads it once per step).
So are the results of ``torch.nn.functional`` losses summed over their samples (``reduction="sum"``): a step
loss (or logged value) that is one of them is a sum over the micro-batch, which combines over micro-batches as
a sum, where a mean combines as a mean.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn import _reduction as _Reduction
from torch.overrides import TorchFunctionMode

from lightning_spot.runtime.layer_outputs import refuse_partial_router_logits
from lightning_spot.runtime.transformers_losses import IGNORE_INDEX, LossCalls

#: the key of a step result that says how many items its loss is a mean over
NUM_ITEMS = "num_items"
#: the key of a step result that says whether its loss is a "sum" over the batch's samples or a "mean"
LOSS_REDUCTION = "loss_reduction"
#: the ``torch.nn.functional`` losses with a ``reduction`` argument, whose sums over samples are noticed
SUMMABLE_LOSSES = frozenset(
    getattr(F, name)
    for name in (
        "binary_cross_entropy", "binary_cross_entropy_with_logits", "cosine_embedding_loss", "cross_entropy",
        "gaussian_nll_loss", "hinge_embedding_loss", "huber_loss", "kl_div", "l1_loss", "margin_ranking_loss",
        "mse_loss", "multi_margin_loss", "multilabel_margin_loss", "multilabel_soft_margin_loss", "nll_loss",
        "poisson_nll_loss", "smooth_l1_loss", "soft_margin_loss", "triplet_margin_loss",
    )
    if hasattr(F, name)
)  # fmt: skip


def either(flag: Tensor | None, other: Tensor) -> Tensor:
    """``flag or other`` for boolean flags kept on the device (``None``: no flag yet), without reading either."""
    return other if flag is None else flag | other.to(flag.device)


class _WatchedLosses(TorchFunctionMode):
    """Notices mean-reduced cross-entropy / NLL losses over targets that hold their ``ignore_index``, and keeps the
    results of losses summed over their samples."""

    MEANS_OVER_TARGETS = (F.cross_entropy, F.nll_loss)

    def __init__(self) -> None:
        super().__init__()
        #: whether a watched loss's targets held the ignore index, on their device (``None``: no such loss)
        self.seen: Tensor | None = None
        #: what losses with ``reduction="sum"`` returned (kept: their ``id`` names them)
        self.sums: list[Tensor] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in SUMMABLE_LOSSES:
            return func(*args, **kwargs)
        bound = inspect.signature(func).bind(*args, **kwargs).arguments
        reduction = bound.get("reduction", "mean")
        legacy = bound.get("size_average") is not None or bound.get("reduce") is not None
        if legacy:  # (size_average=False: a sum)
            reduction = _Reduction.legacy_get_string(bound.get("size_average"), bound.get("reduce"), emit_warning=False)
        result = func(*args, **kwargs)
        if reduction == "sum" and isinstance(result, Tensor):
            self.sums.append(result)
        elif func in self.MEANS_OVER_TARGETS and reduction == "mean" and not legacy:
            target, ignore = bound.get("target"), bound.get("ignore_index", IGNORE_INDEX)
            if isinstance(target, Tensor) and not target.is_floating_point():
                self.seen = either(self.seen, (target == ignore).any())
        return result


class ItemCounts:
    """Item counts of the micro-batch being run: what transformers models computed a loss over, what the step
    declared, and whether a mean over ignored targets was seen."""

    def __init__(self, module: nn.Module, stages: int = 1) -> None:
        #: (loss, items) of every transformers model call with labels in the current micro-batch
        self.seen: list[tuple[Tensor, Tensor]] = []
        #: the pipeline's stages, and whether the micro-batch being run is a training one (for
        #: :func:`refuse_partial_router_logits`)
        self.stages = stages
        self.training = False
        #: whether the micro-batch's watched losses were means over targets holding their ignore index (a flag on
        #: the device; ``None``: none watched)
        self.ignored_targets: Tensor | None = None
        #: what the micro-batch's watched losses summed over their samples returned
        self.sums: list[Tensor] = []
        self._collecting = False
        #: the loss-function calls of the transformers models running now, innermost last
        self._open: list[LossCalls] = []
        self._calls: dict[nn.Module, LossCalls] = {}
        modeling = sys.modules.get("transformers.modeling_utils")  # a model exists only if this was imported
        base = getattr(modeling, "PreTrainedModel", None)  # (not `transformers.X`: that imports it, ~0.15 s)
        if base is None:
            return
        for sub in module.modules():
            if isinstance(sub, base):
                self._calls[sub] = LossCalls(sub)
                sub.register_forward_pre_hook(self._before, with_kwargs=True)
                sub.register_forward_hook(self._after, with_kwargs=True, always_call=True)

    def _before(self, model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if self._collecting:
            calls = self._calls[model]
            calls.start(kwargs)
            self._open.append(calls)

    def _after(self, model: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        if not self._collecting or not self._open:
            return
        calls = self._open.pop()
        calls.stop()
        count = calls.count()
        refuse_partial_router_logits(model, output, self.stages, self.training)
        loss = getattr(output, "loss", None) if not isinstance(output, Tensor) else None
        if count is not None and isinstance(loss, Tensor):
            self.seen.append((loss, count))

    @contextlib.contextmanager
    def micro_batch(self, watch: bool, training: bool = False) -> Iterator[None]:
        """Collect the counts of one run of the user's step (and, with ``watch``, look for ignored targets)."""
        self.seen, self._open, self.ignored_targets, self.sums, self.training = [], [], None, [], training
        self._collecting = True
        mode = _WatchedLosses() if watch else None
        try:
            with mode if mode is not None else contextlib.nullcontext():
                yield
        finally:
            self._collecting = False
            if mode is not None:
                self.ignored_targets, self.sums = mode.seen, mode.sums

    def plain(self) -> bool:
        """Whether the micro-batch just run gave nothing to count: no transformers loss, no watched loss."""
        return not self.seen and self.ignored_targets is None and not self.sums

    def summed(self, value: Any) -> bool:
        """Whether ``value`` is what a watched loss summed over its samples returned in the micro-batch just run."""
        return any(value is s for s in self.sums)

    def count_of(self, result: Any, loss: Tensor) -> Tensor | None:
        """The item count of ``loss``, returned by the step as ``result``: declared, or the count of the
        transformers model whose loss it is; ``None`` when unknown."""
        declared = result.get(NUM_ITEMS) if isinstance(result, Mapping) else None
        if declared is not None:  # (a number goes in an asynchronous copy: a blocking one waits for the device)
            return torch.as_tensor(declared).to(loss.device, non_blocking=not isinstance(declared, Tensor))
        return next((count for seen, count in self.seen if seen is loss), None)

    def counts_by_tensor(self) -> dict[int, Tensor]:
        """Counts keyed by the ``id`` of the loss tensor they belong to (to weigh logged losses)."""
        return {id(loss): count for loss, count in self.seen}
