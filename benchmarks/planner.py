"""Is the planner right? Balanced vs uniform cuts, predicted vs measured step time, and the
planner's choice vs the best layout of a measured sweep — on CPU, several processes, gloo.

The model is an MLP whose blocks are very uneven: residual blocks of width ``--width`` whose hidden
sizes are ``--hidden`` (default ``6144,3072,512,512,512,512,512,512``: the first block costs 12x the
last ones). It trains with AdamW on random data, global batch ``--batch``.

Three measurements, each job a real ``Trainer.fit`` under ``SpotPipelineStrategy`` on W processes
(rank 0's median step time over the timed steps, ``PipelineThroughput``):

(a) ``partition="uniform"`` vs ``partition="balanced"`` on the same layout (P=W, 1F1B);
(b) for every layout of the sweep (all P x D of W, several micro-batch counts, 1F1B and GPipe,
    ``partition="balanced"``), the planner's predicted step time for that exact layout (the
    strategy plans it on the job's own process group: measured layer profile, measured p2p and
    all-reduce speed) against the measured one — goal: within 15%;
(c) the layout that ``pipeline_stages="auto", microbatches="auto", schedule="auto"`` picks,
    measured, against the best measured layout of the sweep — goal: within 10%.

Usage::

    python benchmarks/planner.py                    # W=2 (one process per core here)
    python benchmarks/planner.py --world 4          # W=4 (oversubscribed on 2 cores: the planner knows)
    python benchmarks/planner.py --quick            # smoke run
    python benchmarks/planner.py --json out.json

The layer profile is cached in a temporary directory shared by the jobs of one run, so that every
job's prediction comes from the same profile; communication speeds are measured again by each job.
Nothing sets ``OMP_NUM_THREADS`` in the workers: the strategy sizes its threads as it does for users.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.pipeline_throughput import JobFailed, run_ranks  # noqa: E402

JOB_ENV = "SPOT_PLANNER_JOB"


# =============================================================================== model
def build_model(job: dict[str, Any]):
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self, width: int, hidden: int) -> None:
            super().__init__()
            self.up = nn.Linear(width, hidden)
            self.down = nn.Linear(hidden, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(F.gelu(self.up(x)))

    class UnevenMLP(L.LightningModule):
        """Residual MLP blocks of very different cost in ``self.layers`` (the pipeline-able sequence)."""

        def __init__(self, width: int, hidden: list[int], classes: int = 16) -> None:
            super().__init__()
            self.layers = nn.Sequential(*(Block(width, h) for h in hidden))
            self.head = nn.Linear(width, classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.layers(x))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    L.seed_everything(job["seed"], verbose=False)
    return UnevenMLP(job["width"], job["hidden"])


def dataset(job: dict[str, Any]):
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(job["seed"])
    n = job["batch"] * (job["warmup"] + job["steps"])
    return TensorDataset(torch.randn(n, job["width"], generator=g), torch.randint(0, 16, (n,), generator=g))


# ============================================================================== worker
def worker() -> None:
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_spot import PipelineThroughput, SpotPipelineStrategy

    job = json.loads(os.environ[JOB_ENV])
    seen: dict[str, Any] = {}

    optimizer_times: list[float] = []

    class RecordLayout(L.Callback):
        """The layout actually built, and how long each optimizer update took."""

        def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.global_step > job["warmup"]:
                optimizer_times.append(time.perf_counter() - self._start)

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            seen.update(trainer.strategy.pipeline_layout.to_dict())  # type: ignore[attr-defined]

    strategy = SpotPipelineStrategy(
        pipeline_stages=job["P"],
        microbatches=job["M"],
        schedule=job["schedule"],
        partition=job["partition"],
        activation_checkpointing=job["ac"],
        profile_cache=job["cache"],
        device_memory=job.get("device_memory"),
        offload=job.get("offload"),
        stages_per_rank=job.get("stages_per_rank"),
    )
    timer = PipelineThroughput(warmup_steps=job["warmup"], prog_bar=False)
    extra: list[Any] = []
    if job.get("trace"):  # --trace DIR: a timeline of two timed steps per job, to see where the model is off
        from lightning_spot import PipelineTimeline

        extra.append(
            PipelineTimeline(
                dirpath=f"{job['trace']}/{Path(job['result']).stem}", start_step=job["warmup"] + 1, num_steps=2
            )
        )
    trainer = L.Trainer(
        accelerator=job.get("accelerator", "cpu"),
        precision=job.get("precision", "32-true"),
        devices=job["world"],
        strategy=strategy,
        max_steps=job["warmup"] + job["steps"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer, RecordLayout(), *extra],
    )
    loader = DataLoader(dataset(job), batch_size=job["batch"], shuffle=False, drop_last=True)
    trainer.fit(build_model(job), train_dataloaders=loader)
    if not trainer.is_global_zero:
        return
    from lightning_spot.layout import PipelineLayout

    choice = strategy.layout_choice
    plan = (choice.plan or choice.mixed_plan) if choice is not None else None
    times = timer.step_times
    built = PipelineLayout.from_dict(seen)
    result = {
        "layout": str(built.grid),
        "pipeline_microbatches": list(built.pipeline_microbatches),
        "pipeline_cuts": [list(c) for c in built.pipeline_cuts],
        "samples_per_second": job["batch"] / statistics.median(times),
        "microbatches": seen["microbatches"],
        "schedule": seen["schedule"],
        "cuts": seen["cuts"],
        "ac": bool(plan["activation_checkpointing"]) if plan else bool(job["ac"]),
        "measured": statistics.median(times),
        "predicted": plan["predicted_step_seconds"] if plan else None,
        "predicted_stage_seconds": plan.get("stage_seconds") if plan else None,
        "predicted_detail": plan.get("detail") if plan else None,
        "optimizer_seconds": statistics.median(optimizer_times) if optimizer_times else None,
    }
    weights = strategy.engine.runner.weights if strategy.engine is not None else None
    if weights is not None:  # offload="parameters": most weight bytes on the device at once, of rank 0's
        result["weights"] = {"peak_bytes": weights.peak_bytes, "total_bytes": weights.total_bytes}
    Path(job["result"]).write_text(json.dumps(result))


# ============================================================================ launcher
def run_job(base: dict[str, Any], out: Path, tag: str, **settings: Any) -> dict[str, Any]:
    job = {**base, **settings, "result": str(out / f"{tag}.json")}
    Path(job["result"]).unlink(missing_ok=True)
    print(f"  running {tag} ...", flush=True)
    run_ranks(job["world"], {JOB_ENV: json.dumps(job)}, out / "logs" / tag, timeout=base["timeout"])
    result = json.loads(Path(job["result"]).read_text())
    result["tag"] = tag
    return result


def sweep_layouts(world: int, batch: int, microbatches: list[int]) -> list[tuple[int, int, str]]:
    """(P, M, schedule) for every P dividing ``world`` and every M that keeps the global batch."""
    out = []
    for p in (p for p in range(1, world + 1) if world % p == 0):
        d = world // p
        for m in microbatches:
            if batch % (d * m) or (p > 1 and m < p):
                continue
            out.append((p, m, "1F1B"))
            if p > 1 and m == max(x for x in microbatches if batch % (d * x) == 0):
                out.append((p, m, "GPipe"))
        if p > 1:
            out.append((p, 1, "GPipe"))  # no pipelining at all: one micro-batch
    return out


def pct(a: float, b: float) -> str:
    return f"{(a / b - 1) * 100:+.1f}%"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--hidden", default="6144,3072,512,512,512,512,512,512")
    parser.add_argument("--microbatches", default="1,2,4,8", help="micro-batch counts of the sweep")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per job")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="few steps, few layouts")
    parser.add_argument("--json", type=Path, help="write every result here")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--profile-cache", help="keep the layer profiles here (default: a temporary directory)")
    parser.add_argument("--trace", help="also write a pipeline timeline of two steps of every job under this directory")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.microbatches = 4, 2, "2,4"
    if args.world > 4:
        parser.error("--world above 4 oversubscribes this kind of machine too much to mean anything")

    with tempfile.TemporaryDirectory(prefix="spot-planner-bench-") as tmp:
        out = Path(tmp)
        base = {
            "world": args.world,
            "batch": args.batch,
            "width": args.width,
            "hidden": [int(h) for h in args.hidden.split(",")],
            "steps": args.steps,
            "warmup": args.warmup,
            "seed": 1234,
            "cache": args.profile_cache or str(out / "profiles"),
            "trace": args.trace,
            "timeout": args.timeout,
            "ac": False,
        }
        mbs = [int(m) for m in args.microbatches.split(",")]
        p_full = args.world
        m_ab = max(m for m in mbs if args.batch % m == 0 and m >= p_full)
        try:
            print(f"(a) uniform vs balanced cuts, P{p_full}xD1, {m_ab} micro-batches, 1F1B")
            uniform = run_job(base, out, "uniform", P=p_full, M=m_ab, schedule="1F1B", partition="uniform")
            print(f"(b) sweep of W={args.world} layouts, balanced cuts, predicted vs measured")
            sweep = [
                run_job(base, out, f"P{p}-M{m}-{s}", P=p, M=m, schedule=s, partition="balanced")
                for p, m, s in sweep_layouts(args.world, args.batch, mbs)
            ]
            print("(c) the planner's own choice")
            auto = run_job(base, out, "auto", P="auto", M="auto", schedule="auto", partition="auto", ac=None)
        except JobFailed as err:
            print(f"FAILED: {err}", file=sys.stderr)
            return 1

    balanced = next(
        r for r in sweep if r["layout"] == f"P{p_full}xD1" and r["microbatches"] == m_ab and r["schedule"] == "1F1B"
    )
    lines = [
        f"model: {len(base['hidden'])} residual MLP blocks, width {args.width}, hidden {base['hidden']}; "
        f"global batch {args.batch}; W={args.world}; {args.steps} timed steps (median of rank 0)",
        "",
        f"(a) P{p_full}xD1, {m_ab} micro-batches, 1F1B",
        f"    uniform  cuts {uniform['cuts']}: {uniform['measured'] * 1000:8.1f} ms/step",
        f"    balanced cuts {balanced['cuts']}: {balanced['measured'] * 1000:8.1f} ms/step",
        f"    balanced is {uniform['measured'] / balanced['measured']:.2f}x faster",
        "",
        "(b) layout                      cuts        predicted   measured   error",
    ]
    errors = []
    for r in sweep:
        err = abs(r["predicted"] / r["measured"] - 1)
        errors.append(err)
        name = f"{r['layout']} M={r['microbatches']} {r['schedule']}"
        d = r["predicted_detail"]
        lines.append(
            f"    {name:<28}{r['cuts']!s:<12}{r['predicted'] * 1000:8.1f} ms {r['measured'] * 1000:8.1f} ms"
            f"  {pct(r['predicted'], r['measured']):>7}   predicted pipeline {d['pipeline'] * 1000:.0f} + all-reduce "
            f"{d['allreduce'] * 1000:.0f} + optimizer {d['optimizer'] * 1000:.0f} ms (measured optimizer "
            f"{r['optimizer_seconds'] * 1000:.0f} ms)"
        )
    within = sum(e <= 0.15 for e in errors)
    lines.append(
        f"    mean |error| {statistics.mean(errors) * 100:.1f}%, max {max(errors) * 100:.1f}%; "
        f"{within}/{len(errors)} layouts within 15% (goal: all)"
    )
    best = min(sweep, key=lambda r: r["measured"])
    ac = ", activation checkpointing" if auto["ac"] else ""
    lines += [
        "",
        f"(c) planner chose {auto['layout']} M={auto['microbatches']} {auto['schedule']}{ac}, cuts {auto['cuts']}: "
        f"predicted {auto['predicted'] * 1000:.1f} ms, measured {auto['measured'] * 1000:.1f} ms",
        f"    best of the sweep: {best['layout']} M={best['microbatches']} {best['schedule']}: {best['measured'] * 1000:.1f} ms",
        f"    planner's choice vs best measured: {pct(auto['measured'], best['measured'])} (goal: within +10%)",
    ]
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"uniform": uniform, "sweep": sweep, "auto": auto}, indent=2))
    return 0


if __name__ == "__main__":
    if JOB_ENV in os.environ:
        worker()
    else:
        sys.exit(main())
