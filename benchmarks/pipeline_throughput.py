"""Training throughput of ``spot_pipeline`` against a hand-written ``torch.distributed.pipelining`` loop.

For every P x D layout, the same GPT-style model (the example ``TinyGPT``: d_model 256, 8 blocks,
block size 64 by default) is trained on the same synthetic random tokens, with the same global
batch, the same number of micro-batches and the same schedule (1F1B), in two ways:

* ``strategy``: ``lightning.Trainer(strategy=SpotPipelineStrategy(...))`` with the
  ``PipelineThroughput`` callback; the figure is ``callback.summary()`` (mean over the timed steps).
* ``hand``: a hand-written loop: stage modules built by hand (embeddings + blocks k..l + head),
  ``PipelineStage`` + ``Schedule1F1B``, DDP over the data-parallel group for D > 1, AdamW and the
  same LR schedule; each step times ``schedule.step`` + ``optimizer.step`` + ``zero_grad`` +
  ``scheduler.step``.

Both report rank 0's step times (rank 0 holds the first stage, whose last backward ends the
step). The script is its own launcher: run without ``LOCAL_RANK`` it starts, for each
(layout, implementation), W = P x D worker processes of itself on CPU/gloo (the env-var protocol
Lightning uses for externally launched processes), collects rank 0's JSON result and prints a table.

Usage::

    python benchmarks/pipeline_throughput.py                  # P4xD1 P2xD2 P1xD4 P2xD1 P1xD2, both impls
    python benchmarks/pipeline_throughput.py --quick          # smoke run: P2xD1 P1xD2, few steps
    python benchmarks/pipeline_throughput.py --layouts P2xD2,P1xD4 --steps 30 --json results.json
    python benchmarks/pipeline_throughput.py --impl hand --layouts P4xD1
    python benchmarks/pipeline_throughput.py --repeats 3                     # median of 3 runs per job

``OMP_NUM_THREADS`` is set to 1 in the workers unless it is already set. With more workers than
cores the processes oversubscribe the CPU; the comparison is still like for like. On a small shared
machine one run's step times can differ from the next by 10% or more: use ``--repeats`` (the table
shows the median run; implementations alternate order between rounds) and more ``--steps`` before
reading anything into a difference of a few percent.

The strategy trains ``TinyGPT`` with a bare ``training_step`` (cross-entropy only, no perplexity
metric and no ``self.log``) so that both sides do the same arithmetic; the strategy figure then
includes everything Lightning and ``spot_pipeline`` add around the schedule (loop, hooks, sharded
data loading, gradient hand-over, loss sharing across stages).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # for examples.gpt.model when run from anywhere

JOB_ENV = "SPOT_BENCH_JOB"
DEFAULT_LAYOUTS = "P4xD1,P2xD2,P1xD4,P2xD1,P1xD2"
QUICK_LAYOUTS = "P2xD1,P1xD2"
IMPLS = ("hand", "strategy")


# =============================================================================== model
def model_hparams(job: dict[str, Any]) -> dict[str, Any]:
    return {
        "vocab_size": 256,
        "block_size": job["block_size"],
        "d_model": job["d_model"],
        "n_layer": job["n_layer"],
        "n_head": job["n_head"],
        "max_steps": job["warmup"] + job["steps"],
    }


def synthetic_dataset(job: dict[str, Any]):
    """Random byte tokens, exactly one epoch of ``warmup + steps`` global batches."""
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(job["seed"])
    n = job["batch_size"] * (job["warmup"] + job["steps"])
    tokens = torch.randint(0, 256, (n, job["block_size"] + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def make_optimizer(named_params, hparams: dict[str, Any], total_steps: int):
    """The optimizer and LR schedule of ``TinyGPT.configure_optimizers`` for the given parameters."""
    import torch

    params = [(n, p) for n, p in named_params if p.requires_grad]
    decay = [p for n, p in params if p.dim() >= 2]
    no_decay = [p for n, p in params if p.dim() < 2]
    lr, wd, warmup = 3e-3, 0.1, 20  # TinyGPT defaults
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95)
    )

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def even_bounds(num_layers: int, num_stages: int) -> list[int]:
    """Layer boundaries of an even split, earlier stages get the extra layers (as the strategy does)."""
    base, extra = divmod(num_layers, num_stages)
    bounds = [0]
    for stage in range(num_stages):
        bounds.append(bounds[-1] + base + (1 if stage < extra else 0))
    return bounds


# ====================================================================== hand-written
def run_hand(job: dict[str, Any]) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.nn.parallel import DistributedDataParallel

    from examples.gpt.model import TinyGPT

    P, D, M = job["P"], job["D"], job["microbatches"]
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    assert world == P * D
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (P, D), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = rank // D, rank % D
    pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
    device = torch.device("cpu")

    torch.manual_seed(job["seed"])
    full = TinyGPT(**model_hparams(job))
    full.configure_model()
    bounds = even_bounds(job["n_layer"], P)
    first, last = pp_rank == 0, pp_rank == P - 1

    class HandStage(nn.Module):
        """[embeddings] + blocks[lo:hi] + [final norm + head]."""

        def __init__(self, full: nn.Module) -> None:
            super().__init__()
            if first:
                self.tok_emb, self.pos_emb = full.tok_emb, full.pos_emb
            self.layers = nn.Sequential(*list(full.layers)[bounds[pp_rank] : bounds[pp_rank + 1]])
            if last:
                self.ln_f, self.head = full.ln_f, full.head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if first:
                pos = torch.arange(x.size(1), device=x.device)
                x = self.tok_emb(x) + self.pos_emb(pos)
            x = self.layers(x)
            if last:
                x = self.head(self.ln_f(x))
            return x

    stage_mod = HandStage(full).to(device)
    del full
    submod: nn.Module = stage_mod
    if D > 1:
        import inspect

        # no buffer broadcast before every forward, as the strategy does (the stages have no buffers anyway)
        no_sync_buffers = (
            {"forward_sync_buffers": False}
            if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
            else {"broadcast_buffers": False}
        )
        submod = DistributedDataParallel(stage_mod, process_group=dp_group, **no_sync_buffers)

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())

    stage = PipelineStage(submod, pp_rank, P, device, group=pp_group)
    schedule = Schedule1F1B(stage, n_microbatches=M, loss_fn=loss_fn)
    total = job["warmup"] + job["steps"]
    optimizer, scheduler = make_optimizer(stage_mod.named_parameters(), model_hparams(job), total)

    data = synthetic_dataset(job)
    B = job["batch_size"]
    local = B // D
    times: list[float] = []
    last_loss = float("nan")
    for step in range(total):
        lo = step * B + dp_rank * local
        x, y = data.tensors[0][lo : lo + local], data.tensors[1][lo : lo + local]
        losses: list[torch.Tensor] = []
        t0 = time.perf_counter()
        if first and last:
            schedule.step(x, target=y, losses=losses)
        elif first:
            schedule.step(x)
        elif last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        elapsed = time.perf_counter() - t0
        if step >= job["warmup"]:
            times.append(elapsed)
        if losses:
            last_loss = float(torch.stack([x.detach() for x in losses]).mean())

    # the loss lives on the last stage (dp rank 0 of it: global rank (P-1)*D); share it outside the timing
    box = [last_loss]
    dist.broadcast_object_list(box, src=(P - 1) * D)
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return None
    return _result(times, B, box[0])


# ========================================================================== strategy
def run_strategy(job: dict[str, Any]) -> dict[str, Any] | None:
    import lightning as L
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from examples.gpt.model import TinyGPT
    from lightning_spot import PipelineThroughput, SpotPipelineStrategy

    class BenchGPT(TinyGPT):
        """TinyGPT with a bare training step (no perplexity metric, no logging): the same work as ``hand``."""

        def training_step(self, batch: Any, batch_idx: int):
            x, y = batch
            return F.cross_entropy(self(x).flatten(0, 1).float(), y.flatten())

    class Throughput(PipelineThroughput):
        """Also keeps the loss of the last step (Lightning's ``outputs``) for the report."""

        last_loss = float("nan")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if loss is not None:
                self.last_loss = float(loss)

    P, D, M = job["P"], job["D"], job["microbatches"]
    callbacks: list[Any] = []
    timeline = job.get("timeline", "off")
    if timeline == "absent":  # as before the timeline existed: torch's own stage methods, no clocks
        from torch.distributed.pipelining import PipelineStage

        from lightning_spot.runtime.stages import SpotStage

        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(SpotStage, name, getattr(PipelineStage, name))
    elif timeline == "on":  # every step traced
        from lightning_spot import PipelineTimeline

        callbacks.append(
            PipelineTimeline(dirpath=job["result"] + ".timeline", start_step=0, num_steps=10**6, gantt=False)
        )
    L.seed_everything(job["seed"], verbose=False)
    model = BenchGPT(**model_hparams(job))
    loader = DataLoader(synthetic_dataset(job), batch_size=job["batch_size"], shuffle=False, drop_last=True)
    callback = Throughput(warmup_steps=job["warmup"], prog_bar=False)
    strategy = SpotPipelineStrategy(pipeline_stages=P, microbatches=M, schedule="1F1B")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=P * D,
        strategy=strategy,
        max_steps=job["warmup"] + job["steps"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[callback, *callbacks],
    )
    trainer.fit(model, train_dataloaders=loader)
    if str(strategy.layout) != f"P{P}xD{D}":
        raise RuntimeError(f"strategy picked layout {strategy.layout}, expected P{P}xD{D}")
    if not trainer.is_global_zero:
        return None
    summary = callback.summary()
    if not summary:
        raise RuntimeError("PipelineThroughput recorded no steps after the warm-up")
    times = callback.step_times  # per-step times, for the median
    result = _result(times, job["batch_size"], callback.last_loss) if times else {}
    # the headline figures are the callback's own
    result.update(
        samples_per_sec=summary["samples_per_sec"],
        step_seconds=summary["step_seconds"],
        steps=int(summary["steps"]),
    )
    return result


def _result(times: list[float], global_batch: int, loss: float) -> dict[str, Any]:
    total = sum(times)
    return {
        "samples_per_sec": global_batch * len(times) / total,
        "step_seconds": total / len(times),
        "median_step_seconds": statistics.median(times),
        "steps": len(times),
        "final_loss": loss,
    }


def worker() -> None:
    job = json.loads(os.environ[JOB_ENV])
    result = run_hand(job) if job["impl"] == "hand" else run_strategy(job)
    if result is not None:
        Path(job["result"]).write_text(json.dumps(result))


# ============================================================================ launcher
class JobFailed(RuntimeError):
    pass


def run_ranks(world: int, env: dict[str, str], log_dir: Path, timeout: float) -> None:
    """``world`` worker processes of the calling script (the tests' launcher: timeout, cleanup by pid)."""
    from tests.distributed import WorkerFailure
    from tests.distributed import launch as launch_ranks

    env = {**env, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    script = str(Path(sys.modules["__main__"].__file__).resolve())
    try:
        launch_ranks(world, [script], log_dir=log_dir, timeout=timeout, env=env)
    except WorkerFailure as err:
        raise JobFailed(f"{log_dir.name}: {err}") from err


def launch(job: dict[str, Any], log_dir: Path, timeout: float) -> dict[str, Any]:
    tag = f"P{job['P']}xD{job['D']}-{job['impl']}"
    result_path = Path(job["result"])
    result_path.unlink(missing_ok=True)
    run_ranks(job["P"] * job["D"], {JOB_ENV: json.dumps(job)}, log_dir / tag, timeout)
    if not result_path.exists():
        raise JobFailed(f"{tag}: rank 0 wrote no result (logs in {log_dir / tag})")
    return json.loads(result_path.read_text())


def parse_layouts(text: str) -> list[tuple[int, int]]:
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        m = re.fullmatch(r"[Pp](\d+)[xX][Dd](\d+)", item)
        if not m:
            raise SystemExit(f"bad layout {item!r}: expected e.g. P2xD2")
        out.append((int(m.group(1)), int(m.group(2))))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default=None, help=f"comma-separated PxD layouts (default {DEFAULT_LAYOUTS})")
    p.add_argument("--impl", choices=("both", *IMPLS), default="both")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32, help="global batch; a multiple of D x microbatches")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per replica and step (>= P for 1F1B)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (default 4; --quick 2)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 12; --quick 4)")
    p.add_argument("--repeats", type=int, default=1, help="run every job this often; the table shows the median run")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per job before its workers are killed")
    p.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK_LAYOUTS}, 2 + 4 steps")
    p.add_argument("--json", metavar="PATH", help="also save the results as JSON")
    p.add_argument("--log-dir", help="keep the workers' logs here (default: a temporary folder)")
    args = p.parse_args(argv)
    args.layouts = args.layouts or (QUICK_LAYOUTS if args.quick else DEFAULT_LAYOUTS)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 4)
    args.steps = args.steps if args.steps is not None else (4 if args.quick else 12)
    return args


def check(args: argparse.Namespace, layouts: list[tuple[int, int]]) -> None:
    problems = []
    for P, D in layouts:
        if args.batch_size % (D * args.microbatches):
            problems.append(
                f"P{P}xD{D}: batch size {args.batch_size} is not a multiple of D x microbatches = {D * args.microbatches}"
            )
        if args.microbatches < P:
            problems.append(f"P{P}xD{D}: 1F1B needs microbatches >= P ({args.microbatches} < {P})")
        if args.n_layer < P:
            problems.append(f"P{P}xD{D}: {args.n_layer} layers cannot fill {P} stages")
    if args.steps < 1:
        problems.append("--steps must be >= 1")
    if args.repeats < 1:
        problems.append("--repeats must be >= 1")
    if problems:
        raise SystemExit("invalid configuration:\n  " + "\n  ".join(problems))


def aggregate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (layout, impl): the run with the median samples/s when jobs were repeated."""
    out = []
    keys = list(dict.fromkeys((r["layout"], r["impl"]) for r in rows))
    for layout, impl in keys:
        runs = [r for r in rows if r["layout"] == layout and r["impl"] == impl]
        ok = sorted((r for r in runs if "error" not in r), key=lambda r: r["samples_per_sec"])
        out.append(ok[(len(ok) - 1) // 2] if ok else runs[0])
    return out


def print_table(rows: list[dict[str, Any]], layouts: list[tuple[int, int]]) -> list[str]:
    header = f"{'layout':<7} {'impl':<9} {'samples/s':>10} {'ms/step':>9} {'median ms':>10} {'loss':>7} {'strategy/hand':>14}"
    print(header)
    print("-" * len(header))
    overheads = []
    for P, D in layouts:
        name = f"P{P}xD{D}"
        by_impl = {r["impl"]: r for r in rows if r["layout"] == name}
        for impl in IMPLS:
            r = by_impl.get(impl)
            if r is None:
                continue
            if "error" in r:
                print(f"{name:<7} {impl:<9} {'FAILED':>10}  {r['error'].splitlines()[0][:80]}")
                continue
            ratio = ""
            h = by_impl.get("hand")
            if impl == "strategy" and h and "error" not in h:
                speed = r["samples_per_sec"] / h["samples_per_sec"]
                over = (r["step_seconds"] / h["step_seconds"] - 1) * 100
                ratio = f"{speed:.3f} ({over:+.1f}%)"
                overheads.append(f"{name} {over:+.1f}%")
            print(
                f"{name:<7} {impl:<9} {r['samples_per_sec']:>10.1f} {r['step_seconds'] * 1000:>9.1f} "
                f"{r.get('median_step_seconds', float('nan')) * 1000:>10.1f} {r.get('final_loss', float('nan')):>7.3f} {ratio:>14}"
            )
    return overheads


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    layouts = parse_layouts(args.layouts)
    check(args, layouts)
    impls = IMPLS if args.impl == "both" else (args.impl,)
    tmp = Path(tempfile.mkdtemp(prefix="spot-bench-"))  # result files (and logs without --log-dir)
    log_dir = Path(args.log_dir) if args.log_dir else tmp
    log_dir.mkdir(parents=True, exist_ok=True)
    # with --repeats, every other round runs the implementations in the opposite order
    jobs = [
        (rep, P, D, impl)
        for rep in range(args.repeats)
        for P, D in layouts
        for impl in (impls if rep % 2 == 0 else tuple(reversed(impls)))
    ]
    print(
        f"model: TinyGPT d_model={args.d_model} n_layer={args.n_layer} n_head={args.n_head} block={args.block_size}; "
        f"global batch {args.batch_size}, {args.microbatches} micro-batches per replica, schedule 1F1B; "
        f"{args.warmup} warm-up + {args.steps} timed steps; cpu/gloo, {os.cpu_count()} cores, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1 (set by this script)')}",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    for i, (rep, P, D, impl) in enumerate(jobs, 1):
        job = {
            "impl": impl,
            "P": P,
            "D": D,
            "microbatches": args.microbatches,
            "batch_size": args.batch_size,
            "d_model": args.d_model,
            "n_layer": args.n_layer,
            "n_head": args.n_head,
            "block_size": args.block_size,
            "warmup": args.warmup,
            "steps": args.steps,
            "seed": args.seed,
            "result": str(tmp / f"P{P}xD{D}-{impl}.json"),
        }
        t0 = time.monotonic()
        row: dict[str, Any] = {"layout": f"P{P}xD{D}", "impl": impl, "world_size": P * D, "repeat": rep}
        try:
            row.update(launch(job, log_dir, args.timeout))
            print(
                f"[{i}/{len(jobs)}] P{P}xD{D} {impl:<8} {row['samples_per_sec']:7.1f} samples/s "
                f"{row['step_seconds'] * 1000:7.1f} ms/step  (job {time.monotonic() - t0:.0f}s)",
                flush=True,
            )
        except JobFailed as err:
            row["error"] = str(err)
            print(f"[{i}/{len(jobs)}] P{P}xD{D} {impl} FAILED:\n{err}", file=sys.stderr, flush=True)
        rows.append(row)
    print()
    overheads = print_table(aggregate(rows), layouts)
    print("\nstrategy/hand: samples/s ratio; (%) = extra time per step of the strategy over the hand-written loop")
    if overheads:
        print("strategy overhead vs hand-written pipelining: " + ", ".join(overheads))
    print(f"total wall time {time.monotonic() - started:.0f}s")
    if args.json:
        payload = {
            "config": {k: v for k, v in vars(args).items() if k not in ("json", "log_dir")},
            "cpu_count": os.cpu_count(),
            "results": rows,
        }
        Path(args.json).write_text(json.dumps(payload, indent=2))
        print(f"results saved to {args.json}")
    failed = any("error" in r for r in rows)
    if failed and not args.log_dir:
        print(f"worker logs kept in {tmp}", file=sys.stderr)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ and JOB_ENV in os.environ:
        worker()
    else:
        sys.exit(main())
