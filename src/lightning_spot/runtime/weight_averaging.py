"""Lightning's weight-averaging callbacks on a pipeline: ``WeightAveraging`` (``EMAWeightAveraging``) and
``StochasticWeightAveraging``.

Both copy the whole module when fit sets up, before the strategy keeps this rank's stages only: the copy then
pairs the wrong tensors with the module's (their updates and swaps zip the two modules' parameters in order).
Once the stages are placed, :func:`average_stages` gives each one a copy of this rank's stages instead (the whole
copy is freed). ``WeightAveraging``'s checkpoints keep its two states like the model
(``checkpoint/model_copies.py``), so a run resumes onto any layout with its average.

    average_stages(trainer, module, device)   # after placement, in the strategy's setup
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch import callbacks
from lightning.pytorch.callbacks import StochasticWeightAveraging

#: the callbacks' base class (``None`` in a Lightning without it)
WeightAveraging: type | None = getattr(callbacks, "WeightAveraging", None)

#: what the callbacks keep and :func:`average_stages` sets (Lightning 2.6's names)
_ATTRIBUTES = ("_average_model", "_device", "_use_buffers", "_kwargs")


def average_stages(trainer: pl.Trainer, module: pl.LightningModule, device: Any) -> None:
    """Give every weight-averaging callback that holds a copy of the module a copy of this rank's stages (an
    ``AveragedModel`` on ``device`` unless the callback names one; SWA: the module itself, as it copies it)."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        averaging: Any = callback  # (its attributes are Lightning's private ones, checked below)
        if getattr(averaging, "_average_model", None) is None:
            continue
        if isinstance(callback, StochasticWeightAveraging):
            averaging._average_model = None
            averaging._average_model = deepcopy(module)
            continue
        if WeightAveraging is None or not isinstance(callback, WeightAveraging):
            continue
        if not all(hasattr(averaging, name) for name in _ATTRIBUTES):
            raise RuntimeError(
                f"spot_pipeline: this Lightning's {type(callback).__name__} keeps its averaged model differently "
                f"than lightning-spot expects ({', '.join(_ATTRIBUTES)}); use Lightning 2.6 or leave the callback out"
            )
        from torch.optim.swa_utils import AveragedModel

        averaging._average_model = None  # (the copy of the whole module goes before the stages' is made)
        averaging._average_model = AveragedModel(
            model=module, device=averaging._device or device, use_buffers=averaging._use_buffers, **averaging._kwargs
        )
