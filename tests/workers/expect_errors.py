"""Worker: run scenarios that must fail at setup on every rank; record each error message.

python tests/workers/expect_errors.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import BackboneFinetuning

from lightning_spot import SpotPipelineStrategy
from tests.models import BackboneModel, ManualOptimModel, NoLayersModel, make_loader, make_model

WORLD = int(os.environ["WORLD_SIZE"])

SCENARIOS: dict[str, tuple[Callable[[], L.LightningModule], dict[str, Any], dict[str, Any], dict[str, Any]]] = {
    # name: (model factory, strategy kwargs, trainer kwargs, loader kwargs)
    "stages-do-not-divide-world": (make_model, {"pipeline_stages": 3}, {}, {}),
    "more-stages-than-layers": (lambda: make_model(num_layers=1), {"pipeline_stages": 2}, {}, {}),
    "no-layer-sequence": (NoLayersModel, {"pipeline_stages": 2}, {}, {}),
    "global-batch-not-divisible": (
        make_model,
        {"pipeline_stages": 1, "microbatches": 4},
        {},
        {"batch_size": 12, "n": 48},
    ),
    "manual-optimization": (ManualOptimModel, {"pipeline_stages": 2}, {}, {}),
    # BackboneFinetuning unfreezes the backbone at the first epoch's start, after setup streamed the other weights
    "unfrozen-after-setup-with-streamed-weights": (
        lambda: BackboneModel(),
        {"pipeline_stages": 2, "offload": "parameters"},
        {"callbacks": [BackboneFinetuning(unfreeze_backbone_at_epoch=0)]},
        {},
    ),
}


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    errors: dict[str, str] = {}
    for name, (factory, strategy, trainer_kwargs, loader) in SCENARIOS.items():
        trainer = L.Trainer(
            accelerator="cpu",
            devices=WORLD,
            strategy=SpotPipelineStrategy(timeout=timedelta(seconds=60), **strategy),
            max_steps=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            **trainer_kwargs,
        )
        try:
            trainer.fit(factory(), make_loader(**{"batch_size": 16, **loader}))
        except Exception as err:
            errors[name] = f"{type(err).__name__}: {err}"
        else:
            errors[name] = "no error"
            traceback.print_stack()
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(errors))


if __name__ == "__main__":
    main()
