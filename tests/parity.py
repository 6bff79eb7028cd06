"""Compare spot_pipeline runs with a plain single-process Lightning run of the same model and data."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from tests.distributed import launch
from tests.models import (
    MetaInitPipelineModel,
    Overflow,
    RecordSummary,
    fit_in_this_process,
    lightning_callbacks,
    make_dataset,
    make_loader,
    make_model,
)

WORKER = "tests/workers/run_scenarios.py"


def shared_job(jobs: dict, key: Any, run: Callable[[], Any]) -> Any:
    """What ``run()`` returned, run once for all the tests that read it (``jobs``: a module-scoped fixture). A failure
    is kept too: the tests after the first one fail at once with its summary, instead of running the job again."""
    if key not in jobs:
        try:
            jobs[key] = run()
        except Exception as err:
            jobs[key] = err
            raise
    if isinstance(jobs[key], Exception):
        err = jobs[key]
        pytest.fail(f"the shared job {key!r} failed in an earlier test: {type(err).__name__}: {str(err)[:300]}")
    return jobs[key]


def run_scenarios(
    world_size: int, scenarios: list[dict[str, Any]], tmp: Path, timeout: float = 400
) -> dict[str, list[dict]]:
    """Launch all ``scenarios`` in one ``world_size``-process job; return each scenario's per-rank results."""
    tmp.mkdir(parents=True, exist_ok=True)
    spec = tmp / "scenarios.json"
    spec.write_text(json.dumps(scenarios))
    launch(world_size, [WORKER, str(spec), str(tmp / "out")], log_dir=tmp / "logs", timeout=timeout)
    results = {}
    for s in scenarios:
        results[s["name"]] = [torch.load(tmp / "out" / s["name"] / f"rank{r}.pt") for r in range(world_size)]
    return results


def merged_state(ranks: list[dict], key: str = "state_dict") -> dict[str, torch.Tensor]:
    """Union of the per-rank state dicts; replicas of a stage must agree exactly."""
    merged: dict[str, torch.Tensor] = {}
    for r in ranks:
        for k, v in r[key].items():
            if k in merged:
                assert torch.equal(merged[k], v), f"data-parallel replicas disagree on {k}"
            merged[k] = v
    return merged


def _loader(scenario: dict[str, Any], key: str = "loader") -> DataLoader:
    kwargs = dict(scenario.get(key, {}))
    if kwargs.pop("shuffle", False):
        ds = make_dataset(kwargs.pop("n", 64))
        sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0)
        return DataLoader(ds, sampler=sampler, **kwargs)
    if kwargs.get("random_draws"):  # one process drawing as one replica of the pipeline does (seed 0: no
        # seed_everything), which a plain loader's draws from the process's generators cannot give
        from lightning_spot.data.sharded import shard_dataloader

        return shard_dataloader(make_loader(**kwargs), dp_rank=0, dp_size=1, divisor=None, seed=0)
    return make_loader(**kwargs)


class EpochMetrics(L.Callback):
    """The logged values at each training epoch's end (epoch means among them)."""

    def __init__(self) -> None:
        self.values: list[dict[str, float]] = []

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.values.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def reference_run(
    scenario: dict[str, Any],
    initial: dict[str, torch.Tensor] | None = None,
    save_to: str | None = None,
    resume_from: str | None = None,
) -> dict[str, Any]:
    """The same scenario as plain single-process Lightning training (strategy='auto', 1 CPU); ``save_to``: with a
    checkpoint there each epoch; ``resume_from``: resumed from that checkpoint. A scenario's ``reference_resume``
    (``{"max_epochs": N, "file": name}``) makes it Lightning's own resume: the scenario run to ``N`` epochs, then
    resumed from its checkpoint ``file`` to the end."""
    if scenario.get("reference") == "P1":
        return one_stage_run(scenario)
    resume = scenario.get("reference_resume")
    if resume is not None:
        first = {k: v for k, v in scenario.items() if k != "reference_resume"}
        first["trainer"] = {**scenario.get("trainer", {}), "max_epochs": resume["max_epochs"]}
        with tempfile.TemporaryDirectory() as saved:
            reference_run(first, initial, save_to=saved)
            return reference_run(
                first | {"trainer": scenario["trainer"]}, initial, resume_from=f"{saved}/{resume['file']}"
            )
    model_kwargs = dict(scenario.get("model", {}))
    if model_kwargs.pop("meta_init", False):
        model = MetaInitPipelineModel(**model_kwargs)
        model.configure_model()
    else:
        model = make_model(**model_kwargs)
    if initial is not None:
        model.load_state_dict(initial)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    with tempfile.TemporaryDirectory() as tmp:
        best = None
        options = scenario.get("checkpoint")
        if save_to is not None:
            options = {"every_n_epochs": 1}
        if isinstance(options, dict) and ("monitor" in options or save_to is not None):  # the run's ModelCheckpoint
            from lightning.pytorch.callbacks import ModelCheckpoint

            best = ModelCheckpoint(dirpath=save_to or tmp, save_top_k=-1, **options)
        epochs = EpochMetrics()
        callbacks: list[L.Callback] = [epochs, *([best] if best is not None else [])]
        if "overflow" in scenario:
            callbacks.append(Overflow(**scenario["overflow"]))
        callbacks[:0] = lightning_callbacks(scenario)  # (first: before the checkpoints)
        plugins = []
        if scenario.get(
            "fp16"
        ):  # (the initial loss scale) Lightning runs 16-mixed as bf16 on CPUs unless given a scaler
            from lightning.pytorch.plugins.precision import MixedPrecision

            plugins.append(
                MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=scenario["fp16"]))
            )
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=best is not None,
            callbacks=callbacks,
            plugins=plugins or None,
            enable_progress_bar=False,
            enable_model_summary=False,
            **{"limit_val_batches": 0, **scenario.get("trainer", {})},
        )
        val = _loader(scenario, "val_loader") if "val_loader" in scenario else None
        trainer.fit(model, _loader(scenario), val, ckpt_path=resume_from)
    out: dict[str, Any] = {
        "state_dict": model.state_dict(),
        "initial": start,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "epoch_metrics": epochs.values,
        "summary": next(([c.table, c.totals] for c in trainer.callbacks if isinstance(c, RecordSummary)), None),
        "samples": getattr(model, "samples", None),
    }
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None:
        out["loss_scale"] = float(scaler.get_scale())
    if best is not None and best.monitor is not None:
        out["best_checkpoint"] = (Path(best.best_model_path).name, float(best.best_model_score))
    for stage in scenario.get("after", []):
        eval_loader = make_loader(**scenario.get("eval_loader", {}))
        if stage == "validate":
            out["validate"] = trainer.validate(model, eval_loader, verbose=False)[0]
        elif stage == "test":
            out["test"] = trainer.test(model, eval_loader, verbose=False)[0]
        elif stage == "generate":  # (after fit, on every rank: sampled, from the same seed)
            torch.manual_seed(11)
            out["generate"] = model.sample(do_sample=True, top_k=5)
        elif stage == "predict":
            out["predict"] = trainer.predict(model, eval_loader)
    return out


def one_stage_run(scenario: dict[str, Any]) -> dict[str, Any]:
    """The scenario on one process with ``spot_pipeline`` itself (P1xD1, the scenario's micro-batches): the reference
    where what is drawn at random cannot be one plain process's (a step's noise per micro-batch), only the same on
    every stage; the scenario's run must equal it (seed 0, as the workers have no ``seed_everything``)."""
    import os

    from lightning_spot import SpotPipelineStrategy

    model = make_model(**scenario.get("model", {}))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    epochs, seed = EpochMetrics(), os.environ.pop("PL_GLOBAL_SEED", None)
    strategy = SpotPipelineStrategy(pipeline_stages=1, microbatches=scenario["strategy"]["microbatches"])
    try:
        with tempfile.TemporaryDirectory() as tmp:
            trainer = fit_in_this_process(
                tmp,
                model,
                make_loader(**scenario.get("loader", {})),
                strategy=strategy,
                callbacks=[epochs],
                **{"limit_val_batches": 0, **scenario.get("trainer", {})},
            )
    finally:
        if seed is not None:
            os.environ["PL_GLOBAL_SEED"] = seed
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return {"state_dict": model.state_dict(), "initial": start, "metrics": metrics, "epoch_metrics": epochs.values}


def assert_same_params(got: dict[str, torch.Tensor], ref: dict[str, Any], atol: float = 1e-5) -> None:
    want = ref["state_dict"]
    assert sorted(got) == sorted(want), "the stages together must hold exactly the model's parameters"
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst <= atol, f"parameters differ from the single-process run by {worst:.3g} (> {atol})"
    moved = max((want[k] - ref["initial"][k]).abs().max().item() for k in want)
    assert moved > max(1e-3, 3 * atol), "training did not change the parameters; the comparison would be vacuous"
