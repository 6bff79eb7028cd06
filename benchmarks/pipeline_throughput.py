"""Training throughput of ``spot_pipeline`` against a hand-written ``torch.distributed.pipelining`` loop.

For every model and P x D layout, the same model is trained on the same synthetic data, with the
same global batch, the same number of micro-batches and the same schedule (1F1B), in two ways.
The models (``--model``):

* ``gpt``: the example ``TinyGPT`` (d_model 256, 8 blocks, block size 64 by default), global batch 32;
* ``mlp``: a latency-bound stack of 8 x (Linear 512->512 + GELU), MSE loss, Adam, global batch 64,
  where the fixed cost per step and micro-batch weighs most.

The two ways:

* ``strategy``: ``lightning.Trainer(strategy=SpotPipelineStrategy(...))`` with a callback that only
  notes when each step starts.
* ``hand``: a hand-written loop: stage modules built by hand (embeddings + blocks k..l + head),
  ``PipelineStage`` + ``Schedule1F1B``, DDP over the data-parallel group for D > 1, AdamW and the
  same LR schedule; each step times ``schedule.step`` + ``optimizer.step`` + ``zero_grad`` +
  ``scheduler.step``.

Both report rank 0's step times (rank 0 holds the first stage, whose last backward ends the
step), measured from the start of one step to the start of the next: everything a training loop
does per step, between steps included.

The script is its own launcher: run without ``LOCAL_RANK`` it starts, for each
(layout, implementation), W = P x D worker processes of itself on CPU/gloo (the env-var protocol
Lightning uses for externally launched processes), collects rank 0's JSON result and prints a table.

Usage::

    python benchmarks/pipeline_throughput.py                  # P4xD1 P2xD2 P1xD4 P2xD1 P1xD2, both impls
    python benchmarks/pipeline_throughput.py --quick          # smoke run: P2xD1 P1xD2, few steps
    python benchmarks/pipeline_throughput.py --layouts P2xD2,P1xD4 --steps 30 --json results.json
    python benchmarks/pipeline_throughput.py --impl hand --layouts P4xD1
    python benchmarks/pipeline_throughput.py --repeats 3                     # median of 3 runs per job
    python benchmarks/pipeline_throughput.py --hand-data loader              # the hand loop fetches through a DataLoader
    python benchmarks/pipeline_throughput.py --model mlp --layouts P4xD1 --steps 200 --cpu-breakdown  # CPU per part and rank
    SPOT_BENCH_PROFILE=/tmp/prof python benchmarks/pipeline_throughput.py ...  # + a cProfile of every rank
    SPOT_BENCH_PROFILE_CPU=1 SPOT_BENCH_PROFILE=/tmp/prof ...     # the same, timed in CPU time (waits are free)

The workers run in the environment users have: nothing sets ``OMP_NUM_THREADS``. The strategy sizes
its thread pools itself (``lightning_spot.runtime.process``); the hand-written loop calls
``torch.set_num_threads`` with the same rule (the CPUs / the processes), as a careful hand-written
script does. On a small shared machine one run's step times can differ from the next by 10% or more:
use ``--repeats`` (the table shows the median run; implementations alternate order between rounds)
and more ``--steps`` before reading anything into a difference of a few percent. The table's
overhead columns are the strategy's extra milliseconds per step, and that divided by the micro-batches.

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
DEFAULT_LAYOUTS = "P2xD1,P2xD2,P4xD1"
QUICK_LAYOUTS = "P2xD1,P1xD2"
IMPLS = ("hand", "strategy")
MODELS = ("gpt", "mlp")
#: the global batch of each model unless --batch-size is given
BATCH_SIZES = {"gpt": 32, "mlp": 64}
MLP_WIDTH = 512


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
    """Exactly one epoch of ``warmup + steps`` global batches: random byte tokens, or random vectors (MLP)."""
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(job["seed"])
    n = job["batch_size"] * (job["warmup"] + job["steps"])
    if job.get("model") == "mlp":
        return TensorDataset(torch.randn(n, MLP_WIDTH, generator=g), torch.randn(n, MLP_WIDTH, generator=g))
    tokens = torch.randint(0, 256, (n, job["block_size"] + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def make_mlp(job: dict[str, Any]):
    """The latency-bound MLP as a LightningModule: ``layers`` is its pipeline-able sequence."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch import nn

    class MLPStack(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(
                *[nn.Sequential(nn.Linear(MLP_WIDTH, MLP_WIDTH), nn.GELU()) for _ in range(job["n_layer"])]
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.mse_loss(self(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    return MLPStack()


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
    from torch.utils.data import DataLoader

    from examples.gpt.model import TinyGPT
    from lightning_spot.runtime.process import suggested_threads

    P, D, M = job["P"], job["D"], job["microbatches"]
    torch.set_num_threads(suggested_threads(int(os.environ["LOCAL_WORLD_SIZE"])))
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    assert world == P * D
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (P, D), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = rank // D, rank % D
    pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
    device = torch.device("cpu")

    torch.manual_seed(job["seed"])
    if job.get("model") == "mlp":
        full = make_mlp(job)
    else:
        full = TinyGPT(**model_hparams(job))
        full.configure_model()
    mlp = job.get("model") == "mlp"
    bounds = even_bounds(job["n_layer"], P)
    first, last = pp_rank == 0, pp_rank == P - 1

    class HandStage(nn.Module):
        """[embeddings] + blocks[lo:hi] + [final norm + head]."""

        def __init__(self, full: nn.Module) -> None:
            super().__init__()
            if first and not mlp:
                self.tok_emb, self.pos_emb = full.tok_emb, full.pos_emb
            self.layers = nn.Sequential(*list(full.layers)[bounds[pp_rank] : bounds[pp_rank + 1]])
            if last and not mlp:
                self.ln_f, self.head = full.ln_f, full.head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if mlp:
                return self.layers(x)
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
        if mlp:
            return F.mse_loss(logits, target)
        return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())

    stage = PipelineStage(submod, pp_rank, P, device, group=pp_group)
    schedule = Schedule1F1B(stage, n_microbatches=M, loss_fn=loss_fn)
    total = job["warmup"] + job["steps"]
    if mlp:
        optimizer = torch.optim.Adam(stage_mod.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    else:
        optimizer, scheduler = make_optimizer(stage_mod.named_parameters(), model_hparams(job), total)

    data = synthetic_dataset(job)
    B = job["batch_size"]
    local = B // D

    def first_row(step: int) -> int:  # of this replica's share of the step's global batch
        return step * B + dp_rank * local

    # --hand-data loader: every rank fetches its replica's rows through a DataLoader, as the strategy's ranks do
    rows = [range(first_row(step), first_row(step) + local) for step in range(total)]
    batches = iter(DataLoader(data, batch_sampler=rows)) if job.get("hand_data") == "loader" else None
    starts: list[float] = []
    cpu_start = 0.0
    last_loss = float("nan")
    for step in range(total):
        starts.append(time.perf_counter())
        if step == job["warmup"]:
            cpu_start = time.process_time()
        if batches is not None:
            x, y = next(batches)
        else:
            lo = first_row(step)
            x, y = data.tensors[0][lo : lo + local], data.tensors[1][lo : lo + local]
        losses: list[torch.Tensor] = []
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
        if losses:
            last_loss = float(torch.stack([x.detach() for x in losses]).mean())
        if PROBES is not None:
            PROBES.mark_end()

    times = step_periods(starts, time.perf_counter(), job["warmup"])
    write_cpu_time(job, (time.process_time() - cpu_start) / len(times))
    # the loss lives on the last stage: the mean over its replicas (each holds its rows' mean), as the strategy
    # reports the global batch's; sent from dp rank 0 of it (global rank (P-1)*D), outside the timing
    if D > 1:
        mean = torch.tensor([last_loss], dtype=torch.float64)
        dist.all_reduce(mean, group=dp_group)
        last_loss = float(mean) / D
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
    from lightning_spot import SpotPipelineStrategy

    class BenchGPT(TinyGPT):
        """TinyGPT with a bare training step (no perplexity metric, no logging): the same work as ``hand``."""

        def training_step(self, batch: Any, batch_idx: int):
            x, y = batch
            return F.cross_entropy(self(x).flatten(0, 1).float(), y.flatten())

    class StepTimer(L.Callback):
        """Notes when each step starts and keeps the last loss (Lightning's ``outputs``): nothing else, so
        that the figure is the strategy's and Lightning's cost, not a measuring callback's own."""

        def __init__(self) -> None:
            self.last_loss = float("nan")
            self.starts: list[float] = []
            self.end = 0.0
            self.cpu_start = self.cpu_end = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.starts.append(time.perf_counter())
            if len(self.starts) == job["warmup"] + 1:
                self.cpu_start = time.process_time()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.end = time.perf_counter()
            self.cpu_end = time.process_time()
            if PROBES is not None:
                PROBES.mark_end()
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
    model = make_mlp(job) if job.get("model") == "mlp" else BenchGPT(**model_hparams(job))
    loader = DataLoader(synthetic_dataset(job), batch_size=job["batch_size"], shuffle=False, drop_last=True)
    callback = StepTimer()
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
    write_cpu_time(job, (callback.cpu_end - callback.cpu_start) / job["steps"])
    if not trainer.is_global_zero:
        return None
    times = step_periods(callback.starts, callback.end, job["warmup"])
    if not times:
        raise RuntimeError("no steps were timed after the warm-up")
    return _result(times, job["batch_size"], callback.last_loss)


def step_periods(starts: list[float], end: float, warmup: int) -> list[float]:
    """Seconds from the start of each step after the warm-up to the start of the next (the last: to ``end``):
    everything a training loop does per step, between steps included."""
    bounds = [*starts, end]
    return [b - a for a, b in zip(bounds[warmup:], bounds[warmup + 1 :])]


def rank_file(result: str | Path, kind: str, rank: int | str) -> Path:
    """Where a worker leaves a figure of its own beside the job's result (``kind``: "cpu" or "parts")."""
    return Path(f"{result}.{kind}{rank}")


def write_cpu_time(job: dict[str, Any], seconds_per_step: float) -> None:
    """This rank's CPU time per timed step (all its threads), for the launcher to sum over the ranks: on a machine
    with fewer cores than processes the step time follows the sum."""
    rank_file(job["result"], "cpu", os.environ["RANK"]).write_text(json.dumps(seconds_per_step))


def _result(times: list[float], global_batch: int, loss: float) -> dict[str, Any]:
    total = sum(times)
    return {
        "samples_per_sec": global_batch * len(times) / total,
        "step_seconds": total / len(times),
        "median_step_seconds": statistics.median(times),
        "steps": len(times),
        "final_loss": loss,
    }


#: with --cpu-breakdown: this worker's CPU probes
PROBES: Any = None


def worker() -> None:
    global PROBES
    job = json.loads(os.environ[JOB_ENV])
    if job.get("cpu_breakdown"):
        from benchmarks.cpu_probes import CpuProbes

        PROBES = CpuProbes(job["warmup"])
        PROBES.install(strategy=job["impl"] == "strategy")
    run = run_hand if job["impl"] == "hand" else run_strategy
    profile_dir = os.environ.get("SPOT_BENCH_PROFILE")
    if profile_dir:  # a cProfile of every rank's whole job, in PROFILE_DIR/<impl>-<layout>-rank<R>.prof
        import cProfile

        Path(profile_dir).mkdir(parents=True, exist_ok=True)
        # SPOT_BENCH_PROFILE_CPU=1: the main thread's CPU time instead of wall time (waits then cost nothing)
        cpu = os.environ.get("SPOT_BENCH_PROFILE_CPU") == "1"
        profiler = cProfile.Profile(time.thread_time) if cpu else cProfile.Profile()
        result = profiler.runcall(run, job)
        tag = f"{job['impl']}-P{job['P']}xD{job['D']}-rank{os.environ['RANK']}"
        profiler.dump_stats(str(Path(profile_dir) / f"{tag}.prof"))
    else:
        result = run(job)
    if result is not None:
        Path(job["result"]).write_text(json.dumps(result))
    if PROBES is not None:
        rank_file(job["result"], "parts", os.environ["RANK"]).write_text(json.dumps(PROBES.per_step()))


# ============================================================================ launcher
class JobFailed(RuntimeError):
    pass


def run_ranks(world: int, env: dict[str, str], log_dir: Path, timeout: float) -> None:
    """``world`` worker processes of the calling script (the tests' launcher: timeout, cleanup by pid)."""
    from tests.distributed import WorkerFailure
    from tests.distributed import launch as launch_ranks

    script = str(Path(sys.modules["__main__"].__file__).resolve())
    try:
        launch_ranks(world, [script], log_dir=log_dir, timeout=timeout, env=env)
    except WorkerFailure as err:
        raise JobFailed(f"{log_dir.name}: {err}") from err


def launch(job: dict[str, Any], log_dir: Path, timeout: float) -> dict[str, Any]:
    tag = f"{job.get('model', 'gpt')}-P{job['P']}xD{job['D']}-{job['impl']}"
    result_path = Path(job["result"])
    world = job["P"] * job["D"]
    cpu_paths = [rank_file(result_path, "cpu", rank) for rank in range(world)]
    parts = [rank_file(result_path, "parts", rank) for rank in range(world)]
    for path in (result_path, *cpu_paths, *parts):
        path.unlink(missing_ok=True)
    run_ranks(world, {JOB_ENV: json.dumps(job)}, log_dir / tag, timeout)
    if not result_path.exists():
        raise JobFailed(f"{tag}: rank 0 wrote no result (logs in {log_dir / tag})")
    result = json.loads(result_path.read_text())
    if all(path.exists() for path in cpu_paths):  # CPU seconds per step, summed over the ranks
        result["cpu_seconds_per_step"] = sum(json.loads(path.read_text()) for path in cpu_paths)
    if job.get("cpu_breakdown") and all(path.exists() for path in parts):
        result["cpu_parts"] = [json.loads(path.read_text()) for path in parts]
    return result


def usable_cpus() -> int:
    """The CPUs the ranks may run on (this process's affinity: ``taskset`` and containers narrow it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


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
    p.add_argument("--model", choices=("both", *MODELS), default="both", help="gpt, mlp or both (default)")
    p.add_argument("--impl", choices=("both", *IMPLS), default="both")
    p.add_argument(
        "--hand-data",
        choices=("slice", "loader"),
        default="slice",
        help="how the hand-written loop gets its batches: slices of the data tensors (default), or a DataLoader on "
        "every rank as the strategy's ranks use",
    )
    p.add_argument(
        "--cpu-breakdown",
        action="store_true",
        help="also measure each rank's CPU time per step inside named parts (schedule, stage forwards, data "
        "loading...; benchmarks/cpu_probes.py) and print a table per layout (of the median run)",
    )
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument(
        "--batch-size", type=int, default=None, help="global batch (default: gpt 32, mlp 64); a multiple of D x M"
    )
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
    args.models = MODELS if args.model == "both" else (args.model,)
    return args


def batch_size(args: argparse.Namespace, model: str) -> int:
    return args.batch_size or BATCH_SIZES[model]


def check(args: argparse.Namespace, layouts: list[tuple[int, int]]) -> None:
    problems = []
    for model in args.models:
        B = batch_size(args, model)
        for P, D in layouts:
            if B % (D * args.microbatches):
                problems.append(
                    f"{model} P{P}xD{D}: batch size {B} is not a multiple of D x microbatches = {D * args.microbatches}"
                )
    for P, _ in layouts:
        if args.microbatches < P:
            problems.append(f"P{P}: 1F1B needs microbatches >= P ({args.microbatches} < {P})")
        if args.n_layer < P:
            problems.append(f"P{P}: {args.n_layer} layers cannot fill {P} stages")
    if args.steps < 1:
        problems.append("--steps must be >= 1")
    if args.repeats < 1:
        problems.append("--repeats must be >= 1")
    if problems:
        raise SystemExit("invalid configuration:\n  " + "\n  ".join(problems))


def aggregate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, layout, impl): the run with the median samples/s when jobs were repeated."""
    out = []
    keys = list(dict.fromkeys((r["model"], r["layout"], r["impl"]) for r in rows))
    for model, layout, impl in keys:
        runs = [r for r in rows if (r["model"], r["layout"], r["impl"]) == (model, layout, impl)]
        ok = sorted((r for r in runs if "error" not in r), key=lambda r: r["samples_per_sec"])
        out.append(ok[(len(ok) - 1) // 2] if ok else runs[0])
    return out


def cpu_ms(row: dict[str, Any] | None) -> float:
    """CPU milliseconds per step, summed over the job's ranks (NaN when unknown)."""
    return 1000 * row.get("cpu_seconds_per_step", float("nan")) if row else float("nan")


def print_table(
    rows: list[dict[str, Any]], models: tuple[str, ...], layouts: list[tuple[int, int]], M: int
) -> list[str]:
    header = (
        f"{'model':<5} {'layout':<7} {'hand ms/step':>13} {'strategy ms/step':>17} {'ratio':>7} "
        f"{'overhead ms/step':>17} {'ms/micro-batch':>15} {'CPU ms/step hand/strategy':>26} "
        f"{'loss hand/strategy':>19}"
    )
    print(header)
    print("-" * len(header))
    ratios = []
    for model in models:
        for P, D in layouts:
            name = f"P{P}xD{D}"
            by_impl = {r["impl"]: r for r in rows if r["layout"] == name and r["model"] == model}
            h, st = by_impl.get("hand"), by_impl.get("strategy")
            failed = [f"{impl}: {r['error'].splitlines()[0][:60]}" for impl, r in by_impl.items() if "error" in r]
            if failed:
                print(f"{model:<5} {name:<7} FAILED {'; '.join(failed)}")
                continue

            def ms(r: dict[str, Any] | None) -> float:
                return r["step_seconds"] * 1000 if r else float("nan")

            ratio = ms(st) / ms(h) if h and st else float("nan")
            extra = ms(st) - ms(h)
            losses = f"{(h or {}).get('final_loss', float('nan')):.3f}/{(st or {}).get('final_loss', float('nan')):.3f}"
            cpu = f"{cpu_ms(h):.1f}/{cpu_ms(st):.1f}"
            print(
                f"{model:<5} {name:<7} {ms(h):>13.1f} {ms(st):>17.1f} {ratio:>7.3f} {extra:>17.1f} {extra / M:>15.2f} "
                f"{cpu:>26} {losses:>19}"
            )
            if h and st:
                ratios.append(f"{model} {name} {ratio:.3f}")
    return ratios


def round_ratios(rows: list[dict[str, Any]]) -> list[str]:
    """With --repeats: each round's ratio of the two implementations, which ran back to back (a slow phase of the
    machine then weighs on both), and their median."""
    lines = []
    for model, layout in dict.fromkeys((r["model"], r["layout"]) for r in rows):
        runs = [r for r in rows if (r["model"], r["layout"]) == (model, layout) and "error" not in r]
        by_round: dict[int, dict[str, float]] = {}
        for r in runs:
            by_round.setdefault(r["repeat"], {})[r["impl"]] = r["step_seconds"]
        ratios = [t["strategy"] / t["hand"] for _, t in sorted(by_round.items()) if len(t) == 2]
        if len(ratios) > 1:
            each = " ".join(f"{x:.3f}" for x in ratios)
            lines.append(f"per round: {model} {layout} {each} (median {statistics.median(ratios):.3f})")
    return lines


def print_breakdown(rows: list[dict[str, Any]]) -> None:
    """Per (model, layout): each rank's CPU time per step inside named parts, for both implementations."""
    from benchmarks.cpu_probes import table

    for model, layout in dict.fromkeys((r["model"], r["layout"]) for r in rows):
        by_impl = {
            r["impl"]: r["cpu_parts"]
            for r in rows
            if (r["model"], r["layout"]) == (model, layout) and r.get("cpu_parts")
        }
        if by_impl:
            print(f"\n{model} {layout}: CPU time per step inside each part (thread time; parts nest)")
            print("\n".join(table(by_impl)))


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
        (rep, model, P, D, impl)
        for rep in range(args.repeats)
        for model in args.models
        for P, D in layouts
        for impl in (impls if rep % 2 == 0 else tuple(reversed(impls)))
    ]
    print(
        f"models: {', '.join(args.models)} (gpt: TinyGPT d_model={args.d_model} n_layer={args.n_layer} "
        f"n_head={args.n_head} block={args.block_size}, global batch {batch_size(args, 'gpt')}; mlp: {args.n_layer} x "
        f"(Linear {MLP_WIDTH}->{MLP_WIDTH} + GELU), global batch {batch_size(args, 'mlp')}); {args.microbatches} "
        f"micro-batches per replica, schedule 1F1B; {args.warmup} warm-up + {args.steps} timed steps; cpu/gloo, "
        f"{usable_cpus()} CPUs; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'not set')}",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    for i, (rep, model, P, D, impl) in enumerate(jobs, 1):
        job = {
            "impl": impl,
            "model": model,
            "P": P,
            "D": D,
            "microbatches": args.microbatches,
            "batch_size": batch_size(args, model),
            "d_model": args.d_model,
            "n_layer": args.n_layer,
            "n_head": args.n_head,
            "block_size": args.block_size,
            "warmup": args.warmup,
            "steps": args.steps,
            "seed": args.seed,
            "hand_data": args.hand_data,
            "cpu_breakdown": args.cpu_breakdown,
            "result": str(tmp / f"{model}-P{P}xD{D}-{impl}.json"),
        }
        t0 = time.monotonic()
        row: dict[str, Any] = {"model": model, "layout": f"P{P}xD{D}", "impl": impl, "world_size": P * D, "repeat": rep}
        try:
            row.update(launch(job, log_dir, args.timeout))
            print(
                f"[{i}/{len(jobs)}] {model} P{P}xD{D} {impl:<8} {row['samples_per_sec']:7.1f} samples/s "
                f"{row['step_seconds'] * 1000:7.1f} ms/step {cpu_ms(row):7.1f} CPU ms/step  (job "
                f"{time.monotonic() - t0:.0f}s)",
                flush=True,
            )
        except JobFailed as err:
            row["error"] = str(err)
            print(f"[{i}/{len(jobs)}] {model} P{P}xD{D} {impl} FAILED:\n{err}", file=sys.stderr, flush=True)
        rows.append(row)
    print()
    medians = aggregate(rows)
    ratios = print_table(medians, args.models, layouts, args.microbatches)
    if args.cpu_breakdown:
        print_breakdown(medians)
    print(
        "\nratio: strategy ms/step / hand-written ms/step (goals: <= 1.03 gpt, <= 1.10 mlp); overhead: the "
        "strategy's extra ms per step, and per micro-batch; CPU ms/step: CPU time per step summed over the ranks "
        "(with more processes than cores, step times follow it)"
    )
    shared = [f"P{P}xD{D}" for P, D in layouts if usable_cpus() < P * D]
    if shared:  # (a core per rank, as a GPU host gives, puts most of a rank's fixed cost in its waits instead)
        print(f"ranks share the {usable_cpus()} CPUs in {', '.join(shared)}: each rank's fixed cost slows the others")
    if ratios:
        print("strategy/hand-written: " + ", ".join(ratios))
    for line in round_ratios(rows):
        print(line)
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
