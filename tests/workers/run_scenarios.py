"""Worker: run a list of training scenarios under spot_pipeline and save every rank's results.

python tests/workers/run_scenarios.py SCENARIOS.json OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch

import tests.fakefs  # noqa: F401  registers the slowfile:// and flakyfile:// test filesystems
from lightning_spot import SpotPipelineStrategy
from tests.models import MetaInitPipelineModel, make_loader, make_model


class RecordInitial(L.Callback):
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


WORLD = int(os.environ["WORLD_SIZE"])  # read once: Lightning's teardown removes it from the environment


def run(scenario: dict[str, Any], out: Path) -> None:
    world = WORLD
    model_kwargs = dict(scenario.get("model", {}))
    if os.environ.get("SPOT_TEST_MODEL"):
        import tests.models

        model = getattr(tests.models, os.environ["SPOT_TEST_MODEL"])(**model_kwargs)
    elif model_kwargs.pop("meta_init", False):
        torch.manual_seed(7)
        model = MetaInitPipelineModel(**model_kwargs)
    else:
        model = make_model(**model_kwargs)
    strategy = SpotPipelineStrategy(timeout=timedelta(seconds=90), **scenario.get("strategy", {}))
    record = RecordInitial()
    callbacks: list[L.Callback] = [record]
    target = out / scenario["name"]
    if scenario.get("checkpoint"):
        from lightning.pytorch.callbacks import ModelCheckpoint

        options = scenario["checkpoint"] if isinstance(scenario["checkpoint"], dict) else {"every_n_epochs": 1}
        callbacks.append(ModelCheckpoint(dirpath=target / "ckpts", save_top_k=-1, **options))
    spot = None
    if "spot_checkpoint" in scenario:
        from lightning_spot import SpotCheckpoint

        spot = SpotCheckpoint(**scenario["spot_checkpoint"])
        callbacks.append(spot)
    timeline = throughput = None
    if "timeline" in scenario:
        from lightning_spot import PipelineTimeline

        timeline = PipelineTimeline(dirpath=str(target / "timeline"), **scenario["timeline"])
        callbacks.append(timeline)
    if "throughput" in scenario:
        from lightning_spot import PipelineThroughput

        throughput = PipelineThroughput(**scenario["throughput"])
        callbacks.append(throughput)
    ckpt_path = scenario.get("ckpt_path")
    if "resume" in scenario:
        ckpt_path = str(out / scenario["resume"]["from"] / "ckpts" / scenario["resume"]["file"])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        logger=False,
        enable_checkpointing=bool(scenario.get("checkpoint")),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **{"limit_val_batches": 0, **scenario.get("trainer", {})},
    )
    loader = make_loader(**scenario.get("loader", {}))
    val = make_loader(**scenario["val_loader"]) if "val_loader" in scenario else None
    trainer.fit(model, loader, val, ckpt_path=ckpt_path)
    result: dict[str, Any] = {
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "initial": record.state,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "layout": str(strategy.layout),
        "cuts": strategy.engine.plan.cuts,
        "pipeline": strategy.engine.ctx.dp_rank,
        "microbatches": strategy.engine.microbatches,
        "offload_levels": list(strategy.layout_choice.offload) if strategy.layout_choice else [],
        "reduced_during_backward": strategy.engine.cross.launched_early if strategy.engine.cross else None,
        "parameters": strategy.count_parameters(),
    }
    if strategy.offload is not None:  # where the optimizer's state lives (offload="optimizer")
        states = [
            t for st in trainer.optimizers[0].state.values() for t in st.values() if torch.is_tensor(t) and t.dim()
        ]
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        result["offload"] = {
            "state_dtypes": sorted({str(t.dtype) for t in states}),
            "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "master_dtypes": sorted({str(t.dtype) for t in strategy.offload.masters.values()}),
            "state_shares_param_storage": any(t.untyped_storage().data_ptr() in params for t in states),
            "states": len(states),
        }
    if strategy.engine.runner.activation_offload is not None:  # what went to host memory
        saved = strategy.engine.runner.activation_offload
        result["activation_offload"] = {"tensors": saved.saved_tensors, "bytes": saved.saved_bytes}
    if throughput is not None:
        result["throughput"] = throughput.summary()
        result["pipeline_stats"] = strategy.pipeline_stats()
    if spot is not None:
        result["spot"] = {"saves": spot.saves, "summary": spot.summary(), "url": spot.url}
    if strategy.restored_manifest is not None:
        result["restored_step"] = strategy.restored_manifest["step"]
    if scenario.get("checkpoint"):
        result["checkpoint_files"] = sorted(str(p.relative_to(target / "ckpts")) for p in (target / "ckpts").rglob("*"))
    for stage in scenario.get("after", []):
        eval_loader = make_loader(**scenario.get("eval_loader", {}))
        if stage == "validate":
            result["validate"] = trainer.validate(model, eval_loader, verbose=False)[0]
        elif stage == "test":
            result["test"] = trainer.test(model, eval_loader, verbose=False)[0]
        elif stage == "predict":
            result["predict"] = trainer.predict(model, eval_loader)
    target.mkdir(parents=True, exist_ok=True)
    torch.save(result, target / f"rank{trainer.global_rank}.pt")


def main() -> None:
    scenarios = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    for scenario in scenarios:
        run(scenario, out)


if __name__ == "__main__":
    main()
