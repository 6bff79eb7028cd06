"""Lists on the LightningModule that its steps append to, kept as one process keeps them, on every rank.

Lightning 2's way to use a step's outputs at an epoch's end is a list on the module::

    def validation_step(self, batch, batch_idx):
        self.validation_step_outputs.append(self(batch[0]))

    def on_validation_epoch_end(self):
        preds = torch.cat(self.validation_step_outputs)      # on every rank
        self.validation_step_outputs.clear()

Under a pipeline only the last stage runs a step to its end, once per micro-batch, so its list grows by one
entry per micro-batch and the other ranks' lists stay empty. Around each step:

    appends = StepAppends(module)
    appends.before()                    # every rank, before the step: each list's length
    entries = appends.take(rows)        # the last stage, after it: the step's new entries, merged (or None)
    appends.put(shared_entries)         # every rank: each list as before the step, plus the merged entries

Lists are those of :func:`~lightning_spot.replay.module_lists.module_lists` (public list attributes, and lists in public
dict attributes: one per dataloader, say). The entries a step's micro-batches appended are merged into what one process appends for
the whole batch (:func:`merge_micro_batches`) when every micro-batch appended as many; else they stay one per
micro-batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_spot.replay.module_lists import Place, module_lists


class StepAppends:
    """The lengths of the module's lists before a step, and what the step appended to them."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._lengths: dict[Place, int] = {}

    def before(self) -> None:
        """(Every rank, before a step) note each list's length."""
        self._lengths = {place: len(values) for place, values in module_lists(self.module)}

    def take(self, rows: list[int]) -> dict[Place, list] | None:
        """(The last stage, after a step whose micro-batches held ``rows`` samples each) the entries the step appended
        to each list, merged over its micro-batches; ``None``: nothing appended."""
        taken: dict[Place, list] = {}
        for place, values in module_lists(self.module):
            start = self._lengths.get(place, 0)
            if len(values) > start:
                taken[place] = _merged(values[start:], rows)
        return taken or None

    def put(self, taken: dict[Place, list] | None) -> None:
        """(Every rank) each list as it was before the step, plus the entries the last stage's step appended."""
        if taken is None:
            return
        lists = dict(module_lists(self.module))
        for place, entries in taken.items():
            values = lists.get(place)
            if values is None:  # (a list that a dict of lists got during the step, on the last stage only)
                name, key = place
                values = getattr(self.module, name)[key] = []
            del values[self._lengths.get(place, 0) :]
            values.extend(entries)


def _merged(entries: list, rows: list[int]) -> list:
    """The step's new entries, one per micro-batch each time the step appended: merged into one per append."""
    m = len(rows)
    if m <= 1 or len(entries) % m:
        return entries
    per = len(entries) // m
    return [merge_micro_batches([entries[i * per + j] for i in range(m)], rows) for j in range(per)]


def merge_micro_batches(values: list[Any], rows: list[int]) -> Any:
    """One value from each micro-batch (of ``rows`` samples each), as one process computes it for the batch:
    per-sample tensors concatenated, numbers (floats, 0-dim floating tensors) averaged over the samples, equal
    values kept once, dicts and tuples merged entry by entry; anything else listed per micro-batch."""
    first = values[0]
    if isinstance(first, Tensor):
        if all(isinstance(v, Tensor) and v.dim() > 0 and v.shape[0] == n for v, n in zip(values, rows)):
            return torch.cat(values)
        if all(isinstance(v, Tensor) and v.dim() == 0 and v.is_floating_point() for v in values):
            weights = torch.tensor(rows, dtype=first.dtype, device=first.device)
            return (torch.stack(values) * weights).sum() / weights.sum()
    elif isinstance(first, float) and all(isinstance(v, float) for v in values):
        return sum(v * n for v, n in zip(values, rows)) / sum(rows)
    elif isinstance(first, Mapping) and all(isinstance(v, Mapping) and v.keys() == first.keys() for v in values):
        return {k: merge_micro_batches([v[k] for v in values], rows) for k in first}
    elif isinstance(first, (tuple, list)) and all(type(v) is type(first) and len(v) == len(first) for v in values):
        merged = [merge_micro_batches([v[i] for v in values], rows) for i in range(len(first))]
        if isinstance(first, list):
            return merged
        return type(first)(*merged) if hasattr(first, "_fields") else type(first)(merged)  # (named tuples)
    if all(_same(v, first) for v in values[1:]):
        return first
    return list(values)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
    try:
        return bool(a == b)
    except Exception:  # (values whose comparison is not a truth value)
        return False
