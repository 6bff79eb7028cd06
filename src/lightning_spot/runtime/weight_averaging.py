"""Lightning's ``WeightAveraging`` callbacks (``EMAWeightAveraging``, SWA) on a pipeline.

The callback copies the whole module when fit sets up (``AveragedModel``), before the strategy keeps this rank's
stages only: its copy then pairs the wrong tensors with the module's (``update_parameters`` and the swaps in
validation zip the two modules' parameters in order). Once the stages are placed, :func:`average_stages` gives it a
copy of this rank's stages instead (the whole copy is freed). Checkpoints keep the callback's two states like the
model (``checkpoint/model_copies.py``), so a run resumes onto any layout with its average.

    average_stages(trainer, module, device)   # after placement, in the strategy's setup
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch import callbacks

#: the callbacks' base class (``None`` in a Lightning without it)
WeightAveraging: type | None = getattr(callbacks, "WeightAveraging", None)

#: what the callback keeps and that :func:`average_stages` sets (Lightning 2.6's names)
_ATTRIBUTES = ("_average_model", "_device", "_use_buffers", "_kwargs")


def average_stages(trainer: pl.Trainer, module: pl.LightningModule, device: Any) -> None:
    """Give every ``WeightAveraging`` callback that averages the module an ``AveragedModel`` of this rank's stages
    (on ``device`` unless the callback names one)."""
    if WeightAveraging is None:
        return
    from torch.optim.swa_utils import AveragedModel

    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if not isinstance(callback, WeightAveraging) or getattr(callback, "_average_model", None) is None:
            continue
        averaging: Any = callback  # (its attributes are Lightning's private ones, checked below)
        if not all(hasattr(averaging, name) for name in _ATTRIBUTES):
            raise RuntimeError(
                f"spot_pipeline: this Lightning's {type(callback).__name__} keeps its averaged model differently "
                f"than lightning-spot expects ({', '.join(_ATTRIBUTES)}); use Lightning 2.6 or leave the callback out"
            )
        averaging._average_model = None  # (the copy of the whole module goes before the stages' is made)
        averaging._average_model = AveragedModel(
            model=module, device=averaging._device or device, use_buffers=averaging._use_buffers, **averaging._kwargs
        )
