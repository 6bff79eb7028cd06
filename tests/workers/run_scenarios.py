"""Worker: run a list of training scenarios under spot_pipeline and save every rank's results.

python tests/workers/run_scenarios.py SCENARIOS.json OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch

import tests.fakefs  # noqa: F401  registers the slowfile:// and flakyfile:// test filesystems
from lightning_spot import SpotPipelineStrategy
from lightning_spot.partition.stage_run import active_run
from tests.models import (
    MetaInitPipelineModel,
    Overflow,
    RecordSummary,
    RecordWriter,
    lightning_callbacks,
    make_loader,
    make_model,
)
from tests.parity import EpochMetrics


class CountReductions(L.Callback):
    """The gradient buckets DDP averaged over the replicas in each training batch (a counting communication hook
    around torch's all-reduce hook, on every stage module this rank wraps)."""

    def __init__(self) -> None:
        self.per_batch: list[int] = []
        self._calls = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel

        def counted(group, bucket):  # type: ignore[no-untyped-def]  # (torch refuses annotations other than its own)
            self._calls += 1
            return allreduce_hook(group, bucket)

        for m in trainer.strategy.engine.train_modules.values():
            if isinstance(m, DistributedDataParallel):
                m.register_comm_hook(m.process_group, counted)

    def on_train_batch_end(self, *args: Any) -> None:
        self.per_batch.append(self._calls)
        self._calls = 0


class RecordInitial(L.Callback):
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


class WatchWeights(L.Callback):
    """``offload="parameters"``: from hooks on every module and parameter of this rank's stages, which stages'
    weights have device storage (sizes read from the storages themselves) whenever one of them computes."""

    weights = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = trainer.strategy.engine  # type: ignore[attr-defined]
        self.weights = engine.runner.weights
        if self.weights is None:
            return
        self.most_resident, self.not_resident, self.loads_per_step, self._loads = 0, [], [], self.weights.loads
        self.checks = 0
        for stage, params in self.weights.stage_params.items():
            for layer in engine.stage_modules[stage].owned:
                layer.register_forward_pre_hook(lambda _m, _a, stage=stage: self._forward(stage))
            for p in params:
                p.register_hook(lambda _g, stage=stage: self._check(stage, "backward"))

    def _forward(self, stage: int) -> None:
        run = active_run()
        if run is not None and run.stage == stage:  # (layers of other local stages pass their input through)
            self._check(stage, "forward")

    def _on_device(self, p: torch.Tensor) -> bool:
        return self.weights.device_tensor(p).untyped_storage().nbytes() > 0

    def _check(self, stage: int, phase: str) -> None:
        w = self.weights
        resident = {s for s, params in w.stage_params.items() if any(self._on_device(p) for p in params)}
        self.most_resident = max(self.most_resident, len(resident))
        computes_on_device = all(p.data_ptr() == w.device_tensor(p).data_ptr() for p in w.stage_params[stage])
        if stage not in resident or not computes_on_device:
            self.not_resident.append((stage, phase))
        self.checks += 1

    def on_train_batch_start(self, *args: Any) -> None:
        if self.weights is not None:
            self._loads = self.weights.loads

    def on_train_batch_end(self, *args: Any) -> None:  # (validation's loads are left out)
        if self.weights is not None:
            self.loads_per_step.append(self.weights.loads - self._loads)

    def summary(self) -> dict[str, Any]:
        w = self.weights
        params = [p for ps in w.stage_params.values() for p in ps]
        return {
            "checks": self.checks,
            "most_resident": self.most_resident,
            "not_resident": self.not_resident,
            "loads_per_step": self.loads_per_step,
            "at_rest_on_host": all(
                not self._on_device(p) and p.data_ptr() == w.masters[id(p)].data_ptr() for p in params
            ),
            "stages": len(w.stage_params),
        }


WORLD = int(os.environ["WORLD_SIZE"])  # read once: Lightning's teardown removes it from the environment


def _inputs_kept() -> int:
    """The stages' first-layer inputs still referenced for a recomputation after the run (none should be)."""
    import gc

    from lightning_spot.partition import stage_run

    gc.collect()
    return len(stage_run._FED_INSTEAD)


def _logger(scenario: dict[str, Any], target: Path) -> Any:
    """``"logger": True``: Lightning's CSVLogger in the scenario's folder (else none)."""
    if not scenario.get("logger"):
        return False
    from lightning.pytorch.loggers import CSVLogger

    return CSVLogger(str(target / "logs"))


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
    compiled = torch.compile(model, backend=scenario["compile"]) if scenario.get("compile") else model
    strategy = SpotPipelineStrategy(timeout=timedelta(seconds=90), **scenario.get("strategy", {}))
    record = RecordInitial()
    callbacks: list[L.Callback] = [record]
    watch = WatchWeights()  # (idle unless the weights are streamed: offload="parameters", asked or planned)
    epochs = EpochMetrics()
    callbacks += [watch, epochs]
    reductions = CountReductions() if scenario.get("count_reductions") else None
    callbacks += [reductions] if reductions is not None else []
    target = out / scenario["name"]
    if scenario.get("checkpoint"):
        from lightning.pytorch.callbacks import ModelCheckpoint

        options = scenario["checkpoint"] if isinstance(scenario["checkpoint"], dict) else {"every_n_epochs": 1}
        callbacks.append(ModelCheckpoint(dirpath=target / "ckpts", save_top_k=-1, **options))
    spot = None
    if scenario.get("slow_snapshot_copies"):  # the background copies start late: the next step must wait for them
        import time

        from lightning_spot.checkpoint.memory import snapshotter

        finish, delay = snapshotter._finish_copies, scenario["slow_snapshot_copies"]
        snapshotter._finish_copies = lambda pending: (time.sleep(delay) if pending else None) or finish(pending)  # type: ignore[assignment]
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
    plugins = []
    if scenario.get("fp16"):  # (the initial loss scale) Lightning runs 16-mixed as bf16 on CPUs unless given a scaler
        from lightning.pytorch.plugins.precision import MixedPrecision

        plugins.append(
            MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=scenario["fp16"]))
        )
    if "overflow" in scenario:
        callbacks.append(Overflow(**scenario["overflow"]))
    callbacks[:0] = lightning_callbacks(scenario)  # (first: before the checkpoints)
    ckpt_path = scenario.get("ckpt_path")
    if "resume" in scenario:
        ckpt_path = str(out / scenario["resume"]["from"] / "ckpts" / scenario["resume"]["file"])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        logger=_logger(scenario, target),
        enable_checkpointing=bool(scenario.get("checkpoint")),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        plugins=plugins or None,
        **{"limit_val_batches": 0, **scenario.get("trainer", {})},
    )
    loader = make_loader(**scenario.get("loader", {}))
    val = make_loader(**scenario["val_loader"]) if "val_loader" in scenario else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        trainer.fit(compiled, loader, val, ckpt_path=ckpt_path)
    result: dict[str, Any] = {
        "warnings": [str(w.message) for w in caught if issubclass(w.category, UserWarning)],
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "initial": record.state,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "epoch_metrics": epochs.values,
        "summary": next(([c.table, c.totals] for c in trainer.callbacks if isinstance(c, RecordSummary)), None),
        "layout": str(strategy.layout),
        "cuts": strategy.engine.plan.cuts,
        "pipeline": strategy.engine.ctx.dp_rank,
        "stage_rank": strategy.engine.ctx.pp_rank,
        "samples_read": getattr(getattr(loader, "dataset", None), "samples_read", None),  # (a test stream's count)
        "microbatches": strategy.engine.microbatches,
        "offload_levels": list(strategy.layout_choice.offload) if strategy.layout_choice else [],
        "reduced_during_backward": strategy.engine.cross.launched_early if strategy.engine.cross else None,
        "parameters": strategy.count_parameters(),
        "compiled_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
        "inputs_kept": _inputs_kept(),
        "samples": getattr(model, "samples", None),  # (written at validations' ends)
    }
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None:  # fp16: where the loss scale ended, and the scaler every rank agreed with
        result["loss_scale"] = float(scaler.get_scale())
        result["scaler"] = type(scaler).__name__
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
            "early_copies_used": strategy.offload.early_copies_used,
        }
    if reductions is not None:
        result["reductions"] = reductions.per_batch
    if watch.weights is not None:  # which weights were on the device while each stage computed
        result["weights"] = watch.summary()
    if strategy.engine.runner.activation_offload is not None:  # what went to host memory
        saved = strategy.engine.runner.activation_offload
        result["activation_offload"] = {
            "tensors": saved.saved_tensors,
            "bytes": saved.saved_bytes,
            "prefetched": saved.prefetched,
            "prefetch_hits": saved.prefetch_hits,
        }
    if throughput is not None:
        result["throughput"] = throughput.summary()
        result["pipeline_stats"] = strategy.pipeline_stats()
    if spot is not None:
        result["spot"] = {"saves": spot.saves, "summary": spot.summary(), "url": spot.url}
        if spot.snapshotter is not None:  # how each snapshot was copied (into a mapped file?) and whether it stood
            result["spot"]["snapshots"] = spot.snapshotter.taken
    if strategy.restored_manifest is not None:
        result["restored_step"] = strategy.restored_manifest["step"]
        result["restored_tier"] = strategy.restored_manifest.get("tier")  # "memory" (snapshots) or "storage"
        result["restored_kind"] = strategy.restored_manifest.get("kind")  # "shares": made of snapshot files
    if scenario.get("checkpoint"):
        result["checkpoint_files"] = sorted(str(p.relative_to(target / "ckpts")) for p in (target / "ckpts").rglob("*"))
        best = trainer.checkpoint_callback
        if best is not None and best.monitor is not None and best.best_model_path:
            result["best_checkpoint"] = (Path(best.best_model_path).name, float(best.best_model_score))
    for stage in scenario.get("after", []):
        eval_loader = make_loader(**scenario.get("eval_loader", {}))
        if stage == "validate":
            result["validate"] = trainer.validate(model, eval_loader, verbose=False)[0]
        elif stage == "test":
            result["test"] = trainer.test(model, eval_loader, verbose=False)[0]
        elif stage == "generate":  # (after fit, on every rank: sampled, from the same seed)
            torch.manual_seed(11)
            result["generate"] = model.sample(do_sample=True, top_k=5)
        elif stage == "predict":
            result["predict"] = trainer.predict(model, eval_loader)
            writer = next((c for c in trainer.callbacks if isinstance(c, RecordWriter)), None)
            if writer is not None:
                result["written"] = {"batches": writer.batches, "epochs": writer.epochs}
    target.mkdir(parents=True, exist_ok=True)
    torch.save(result, target / f"rank{trainer.global_rank}.pt")


def main() -> None:
    scenarios = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    for scenario in scenarios:
        run(scenario, out)


if __name__ == "__main__":
    main()
