"""Worker: validate a pretrained Hugging Face model pipelined and write what each rank read.

python tests/workers/pretrained_validate.py PRETRAINED_DIR OUT_DIR PIPELINE_STAGES
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L

from lightning_spot import SpotPipelineStrategy
from tests.hf_models import PretrainedCausalLM, token_loader


def main() -> None:
    path, out, stages = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    strategy = SpotPipelineStrategy(pipeline_stages=stages, microbatches=2, pretrained=path)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=stages,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = PretrainedCausalLM(path)
    metrics = trainer.validate(model, token_loader(batch_size=8, n=32), verbose=False)[0]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{trainer.global_rank}.json").write_text(
        json.dumps(
            {
                "val_loss": metrics["val_loss"],
                "reads": strategy.pretrained_reads,
                "local": sorted(model.state_dict()),
                "parameters": sum(p.numel() for p in model.parameters()),
            }
        )
    )


if __name__ == "__main__":
    main()
