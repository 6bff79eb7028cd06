"""Which losses and logged values of a step are sums over their micro-batch's samples (``reduction="sum"``).

    sums = SummedLosses()
    summed = sums.loss_is_sum(result, loss, items)      # the last stage, each training micro-batch
    sums.mark("training_step", records, items, summed_loss=loss if summed else None)  # its logged values
    sums.warn_unsure()                                  # once per step, after it

One process computes a sum over the whole batch; a micro-batch's sum is a part of it, so the step's sums add
up over micro-batches (and replicas), where means average (:mod:`lightning_spot.runtime.loss_weights`). A loss
is a sum when the step says so (``return {"loss": loss, "loss_reduction": "sum"}``) or when it is, as the
same tensor, what a ``torch.nn.functional`` loss with ``reduction="sum"`` returned in one of the first watched
steps (:class:`~lightning_spot.runtime.item_counts.ItemCounts`); a logged value is summed when it is such a
tensor, or the summed loss. Both are remembered (a step function's code is the same from step to step). A sum
that the step transforms before returning it (a sum plus a KL term, a sum divided by the batch size) cannot be
told from a mean: a warning asks the step to say which.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from lightning_spot.partition.discovery import ModelContractError
from lightning_spot.runtime.item_counts import LOSS_REDUCTION, ItemCounts
from lightning_spot.runtime.logging_bridge import LogRecord

UNSURE_SUM = (
    "spot_pipeline: training_step computed a loss summed over samples (a torch.nn.functional loss with "
    "reduction='sum') and returned another tensor, which is taken for a mean over the micro-batch: a step's "
    "micro-batch losses are averaged. If the returned loss is a sum over the batch's samples (e.g. a VAE's "
    "reconstruction sum plus its KL term), say so, and its micro-batches add up as one process's sum does: "
    "`return {'loss': loss, 'loss_reduction': 'sum'}` (plain Lightning ignores the extra key); if it is a mean "
    "(e.g. the sum divided by the batch size), `'loss_reduction': 'mean'` silences this warning."
)


class SummedLosses:
    """What was found to be a sum over samples: the training loss, and logged names per step function."""

    def __init__(self) -> None:
        #: whether the training step's loss was seen to be a watched sum (remembered after the watched steps)
        self.loss_sum = False
        #: per step function, the logged names whose values were seen to be sums
        self.names: dict[str, set[str]] = {}
        self._unsure = False
        self._warned = False

    def loss_is_sum(self, result: Any, loss: Any, items: ItemCounts, counted: bool = False) -> bool:
        """Whether the training micro-batch's ``loss`` (returned as ``result``) is a sum over its samples (``counted``:
        it came with an item count, so it is a mean unless declared otherwise)."""
        declared = result.get(LOSS_REDUCTION) if isinstance(result, Mapping) else None
        if declared is not None:
            if declared not in ("sum", "mean"):
                raise ModelContractError(
                    f"training_step returned {LOSS_REDUCTION}={declared!r}; it says how the loss reduces the "
                    f"batch's samples: 'sum' or 'mean'."
                )
            return bool(declared == "sum")
        if items.summed(loss):
            self.loss_sum = True
        elif items.sums and not self.loss_sum and not counted:
            self._unsure = True
        return self.loss_sum and not counted

    def mark(self, fn_name: str, records: list[LogRecord], items: ItemCounts, summed_loss: Any = None) -> None:
        """Mark the micro-batch's logged ``records`` that are sums over its samples (a watched sum, the summed loss,
        or a name seen as one before) to be summed over micro-batches."""
        names = self.names.get(fn_name)
        if not records or (names is None and not items.sums and summed_loss is None):
            return
        names = self.names.setdefault(fn_name, set())
        ids = {id(t) for t in items.sums} | ({id(summed_loss)} if summed_loss is not None else set())
        for record in records:
            if record.source in ids:
                names.add(record.name)
            record.summed = record.name in names

    def warn_unsure(self) -> None:
        """(After a training step) warn, once, if a watched sum was seen but the returned loss was another tensor
        that nothing declared."""
        if self._unsure and not self._warned and not self.loss_sum:
            self._warned = True
            warnings.warn(UNSURE_SUM, UserWarning, stacklevel=1)
