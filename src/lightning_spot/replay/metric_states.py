"""Copies of ``torchmetrics.Metric`` states, and putting them back.

kept = copied_states(metric)       # before something that may update it
restore_states(metric, kept)
with metrics_kept(module):         # every metric of ``module`` as it was afterwards
    ...
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn
from torchmetrics import Metric


def copied_states(metric: Metric) -> dict[str, Any]:
    """Copies of ``metric``'s states and counters, for :func:`restore_states`."""
    kept: dict[str, Any] = {
        attr: value.detach().clone() if isinstance(value, Tensor) else list(value)
        for attr, value in ((a, getattr(metric, a)) for a in metric._defaults)
    }
    kept.update(_update_count=metric._update_count, _computed=metric._computed, _forward_cache=metric._forward_cache)
    return kept


def restore_states(metric: Metric, kept: dict[str, Any]) -> None:
    """Put back what :func:`copied_states` took (states and counters)."""
    for attr, value in kept.items():
        setattr(metric, attr, value)


@contextlib.contextmanager
def metrics_kept(module: nn.Module) -> Iterator[None]:
    """Every ``Metric`` of ``module`` as it was before the block (a run of the step outside training counts in
    none of them)."""
    kept = [(m, copied_states(m)) for m in module.modules() if isinstance(m, Metric)]
    try:
        yield
    finally:
        for metric, states in kept:
            restore_states(metric, states)
