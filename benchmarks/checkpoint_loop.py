"""End-to-end cost of checkpoints and in-memory snapshots on the training loop, in the users' environment.

The case of issue 13: an MLP of 8 x (Linear 512->512 + GELU) (~2.1 M parameters, ~25 MB with Adam
state) trained with ``SpotPipelineStrategy(pipeline_stages=2)`` on 2 CPU processes (P2xD1, 1F1B,
4 micro-batches, global batch 64), nothing setting ``OMP_NUM_THREADS``. Variants, run in turn and
repeated in alternating order (medians shown):

* ``none``: no ``SpotCheckpoint`` at all;
* ``default``: ``SpotCheckpoint(dirpath=...)`` with nothing else: snapshots and durable saves at intervals it
  chooses (issue 29);
* ``default/20``: ``SpotCheckpoint(every_n_train_steps=20)`` as the README shows it: durable checkpoints every 20
  steps, made from snapshots, which are also taken at their chosen interval (the defaults);
* ``durable/20``: ``SpotCheckpoint(every_n_train_steps=20, snapshots=False)``: the durable tier alone (DCP
  shards) to a local directory;
* ``snapshot/N``: ``SpotCheckpoint(every_n_train_steps=10**6, snapshot_every_n_train_steps=N)`` (memory
  only, apart from the checkpoint at the end);
* ``durable/20+snapshot``: durable checkpoints every 20 steps made from a snapshot of the same step (the
  snapshot's files uploaded as they are, checkpoint kind ``"shares"``);
* ``both``: snapshots every 5 steps and durable checkpoints every 20 (from the snapshots).

The figure is rank 0's wall time from the start of the first step to the end of the last step
(everything the loop does, background work competing for the CPU included), over ``none``'s; goal for
``durable/20`` (issue 13): within 2%; for ``default/20`` (issue 29): within 2%. The time to commit the last checkpoint after training is shown apart, and with
``--block`` the CPU time rank 0's background threads spend per snapshot write and per durable save.

Usage::

    python benchmarks/checkpoint_loop.py                  # 200 steps, 3 repeats
    python benchmarks/checkpoint_loop.py --quick          # 40 steps, 1 repeat
    python benchmarks/checkpoint_loop.py --variants none,durable/20 --repeats 5
    python benchmarks/checkpoint_loop.py --block 20 --steps 2000 --variants durable/20,durable/20+snapshot
    python benchmarks/checkpoint_loop.py --block 100 --steps 700 --batch-size 128   # ~32 ms steps

``--model gpt2`` trains a Hugging Face ``GPT2LMHeadModel`` instead (random weights: 8 blocks of width 160,
byte vocabulary, tied embeddings, AdamW, global batch 8 of 32 tokens; ~2.5 M parameters, ~30 MB of state), a model
this project did not write, through the same strategy and callback (``pip install transformers``).

``--block`` compares inside each run (checkpoints on in every other block of steps), which removes the
run-to-run scatter of several percent that whole-run comparisons suffer on a shared machine. ``--block 20``
with durable checkpoints every 20 steps puts one save at the start of each block with checkpoints (its
background work ends inside it), and 2000 steps give 50 blocks each way: the least scatter per minute.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.pipeline_throughput import make_mlp, run_ranks, synthetic_dataset  # noqa: E402

JOB_ENV = "SPOT_CKPT_LOOP_JOB"
GOAL = 0.02


def run(job: dict[str, Any]) -> None:
    """One rank of one variant; rank 0 writes its loop times."""
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_spot import SpotCheckpoint, SpotPipelineStrategy
    from lightning_spot.checkpoint.memory.snapshotter import Snapshotter

    background_cpu = {"snapshot": [], "save": []}  # thread CPU seconds of each background write (this rank)
    _count_thread_cpu(Snapshotter, "_write", background_cpu["snapshot"])
    _count_thread_cpu(SpotCheckpoint, "_write", background_cpu["save"])

    class LoopTimer(L.Callback):
        start = last = end = cpu_start = cpu_last = 0.0

        def __init__(self) -> None:
            self.steps: list[float] = []  # seconds from the end of one step to the end of the next

        def on_train_batch_start(self, *args: Any) -> None:
            if not self.start:
                self.start, self.cpu_start = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, *args: Any) -> None:
            now = time.perf_counter()
            if self.last or self.start:
                self.steps.append(now - (self.last or self.start))
            self.last, self.cpu_last = now, time.process_time()

        def on_train_end(self, *args: Any) -> None:
            self.end = time.perf_counter()

    callbacks: list[L.Callback] = []
    variant = job["variant"]
    spot = None
    if variant != "none":
        durable = {"durable/20": 20, "default/20": 20, "both": 20, "durable/20+snapshot": 20, "default": None}.get(
            variant, 10**6
        )
        snapshot = {"both": 5, "durable/20+snapshot": 20}.get(
            variant, int(variant.split("/")[1]) if variant.startswith("snapshot/") else 0
        )
        spot = SpotCheckpoint(
            dirpath=job.get("dirpath", job["root"] + "/ckpt"),
            storage_options=job.get("storage_options"),
            every_n_train_steps=durable,
            snapshots=variant != "durable/20",
            snapshot_every_n_train_steps=snapshot or None,
            snapshot_dir=job["root"] + "/shm" if job.get("shm_in_root") else None,
            preemption=False,
        )
        callbacks.append(spot)
    timer = LoopTimer()
    callbacks.append(timer)  # after SpotCheckpoint: a step's time includes its save's stall
    block = job.get("block", 0)
    if block and spot is not None:  # A/B inside one process: checkpoints on in odd blocks of steps only
        durable_every, snapshot_every = spot.every_n_train_steps, spot.snapshot_every_n_train_steps

        class Blocks(L.Callback):
            def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
                on = ((trainer.global_step + 1) // block) % 2 == 1  # the step about to run
                assert spot is not None
                spot.every_n_train_steps = durable_every if on else 10**6
                spot.snapshot_every_n_train_steps = snapshot_every if on else 10**6
                if spot.cadence.snapshots and snapshot_every is None:  # snapshots at the interval it chooses
                    spot.cadence.snapshot_seconds = None if on else 1e9

        callbacks.insert(0, Blocks())
    L.seed_everything(0, verbose=False)
    dataset = synthetic_dataset(job) if job["model"] == "mlp" else _token_dataset(job)
    loader = DataLoader(dataset, batch_size=job["batch_size"], shuffle=False, drop_last=True)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SpotPipelineStrategy(pipeline_stages=2, microbatches=4, schedule="1F1B"),
        max_steps=job["steps"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=job["root"],
        callbacks=callbacks,
    )
    trainer.fit(make_mlp(job) if job["model"] == "mlp" else _make_gpt2(), train_dataloaders=loader)
    if trainer.is_global_zero:
        out = {
            "loop_seconds": timer.last - timer.start,
            "after_seconds": timer.end - timer.last,
            "cpu_seconds": timer.cpu_last - timer.cpu_start,  # rank 0's process, every thread
            "step_seconds": timer.steps,
        }
        if spot is not None and spot.snapshotter is not None:
            taken = spot.snapshotter.taken
            out["snapshot_stall"] = statistics.mean(t["stall_seconds"] for t in taken)
            out["snapshot_write"] = statistics.mean(t.get("write_seconds", 0.0) for t in taken)
        if spot is not None and spot.saves:
            out["save_stall"] = statistics.mean(s["stall_seconds"] for s in spot.saves)
            out["save_write"] = statistics.mean(s.get("write_seconds", 0.0) for s in spot.saves)
        out.update({f"{k}_cpu": statistics.mean(v) for k, v in background_cpu.items() if v})
        Path(job["result"]).write_text(json.dumps(out))


GPT2_SEQ = 32


def _make_gpt2() -> Any:
    """A Hugging Face GPT-2 language model (random weights) as a user would wrap it: nothing pipeline-specific."""
    import lightning as L
    import torch
    import transformers

    class GPT2(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            config = transformers.GPT2Config(
                n_layer=8, n_embd=160, n_head=4, vocab_size=256, n_positions=GPT2_SEQ, tie_word_embeddings=True
            )
            self.model = transformers.GPT2LMHeadModel(config)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return GPT2()


def _token_dataset(job: dict[str, Any]) -> Any:
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(job["seed"])
    return TensorDataset(torch.randint(0, 256, (job["batch_size"] * job["steps"], GPT2_SEQ), generator=g))


def _count_thread_cpu(cls: type, name: str, into: list[float]) -> None:
    """Make ``cls.name`` append the CPU time its calling thread spends in it to ``into``."""
    original = getattr(cls, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return original(*args, **kwargs)
        finally:
            into.append(time.thread_time() - start)

    setattr(cls, name, counted)


def block_ratio(steps: list[float], block: int) -> float:
    """Mean step time with checkpoints / without, from one run's step times (warm-up block and last step out)."""
    on, off = [], []
    for j, seconds in enumerate(steps[:-1]):
        if (j + 1) // block == 0:
            continue
        (on if ((j + 1) // block) % 2 == 1 else off).append(seconds)
    return statistics.mean(on) / statistics.mean(off)


def print_blocks(rows: list[dict[str, Any]], variants: list[str], block: int) -> None:
    print(f"\n{'variant':<20} {'with / without, per run':<40} {'median':>8}  (blocks of {block} steps)")
    for variant in variants:
        if variant == "none":
            continue
        ratios = [block_ratio(r["step_seconds"], block) for r in rows if r["variant"] == variant]
        runs = " ".join(f"{100 * (x - 1):+.1f}%" for x in ratios)
        goal = f"  (goal {100 * GOAL:.0f}%)" if variant in ("durable/20", "default/20") else ""
        print(f"{variant:<20} {runs:<40} {100 * (statistics.median(ratios) - 1):+7.1f}%{goal}")
    print("\nbackground CPU per write, rank 0, thread CPU time (medians over runs of each run's mean):")
    for variant in variants:
        runs_of = [r for r in rows if r["variant"] == variant]
        cells = [
            f"{label} {1000 * statistics.median(r[key] for r in runs_of):.1f} ms"
            for key, label in (("snapshot_cpu", "snapshot"), ("save_cpu", "durable upload + commit"))
            if runs_of and all(key in r for r in runs_of)
        ]
        if cells:
            print(f"{variant:<20} {', '.join(cells)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default="none,default/20,default,durable/20,durable/20+snapshot,snapshot/5,both")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="global batch (default 64 for the MLP: ~26 ms steps on 2 cores, 128: ~32 ms; 8 for GPT-2)",
    )
    parser.add_argument("--model", choices=("mlp", "gpt2"), default="mlp", help="the MLP of issue 13, or HF GPT-2")
    parser.add_argument("--quick", action="store_true", help="40 steps, one repeat")
    parser.add_argument(
        "--s3",
        action="store_true",
        help="checkpoints to an S3 bucket on a moto server this script starts on 127.0.0.1 (instead of a local dir)",
    )
    parser.add_argument("--json", help="write every run's figures here")
    parser.add_argument(
        "--block",
        type=int,
        default=0,
        help="A/B inside each run: checkpoints on in every other block of this many steps; the figure is the "
        "mean step time of the blocks with checkpoints over the blocks without (the first block is warm-up)",
    )
    args = parser.parse_args(argv)
    if args.batch_size is None:
        args.batch_size = 64 if args.model == "mlp" else 8
    if args.quick:
        args.steps, args.repeats = 40, 1
    variants = args.variants.split(",")
    print(
        f"checkpoint_loop: {'MLP 8 x 512, Adam' if args.model == 'mlp' else 'HF GPT-2 8 x 160, AdamW'}, P2xD1 1F1B "
        f"M=4, global batch {args.batch_size}, {args.steps} steps, "
        f"{os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'not set')}",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="spot-ckpt-loop-") as tmp, _storage(args.s3, Path(tmp)) as s3:
        for rep in range(args.repeats):
            for variant in variants if rep % 2 == 0 else list(reversed(variants)):
                tag = f"{variant.replace('/', '-')}-{rep}"
                job = {
                    "variant": variant,
                    "model": args.model,
                    "n_layer": 8,
                    "batch_size": args.batch_size,
                    "steps": args.steps,
                    "warmup": 0,
                    "seed": 0,
                    "root": f"{tmp}/{tag}",
                    "result": f"{tmp}/{tag}.json",
                    "block": args.block,
                }
                if s3 is not None:
                    job["dirpath"], job["storage_options"] = f"s3://{s3['bucket']}/{tag}", s3["options"]
                run_ranks(2, {JOB_ENV: json.dumps(job)}, Path(tmp) / "logs" / tag, 600)
                row = {"variant": variant, "repeat": rep, **json.loads(Path(job["result"]).read_text())}
                rows.append(row)
                print(f"  {variant:<20} run {rep + 1}: loop {row['loop_seconds']:.2f}s", flush=True)
    if args.block:
        print_blocks(rows, variants, args.block)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return 0
    base = {r["repeat"]: r["loop_seconds"] for r in rows if r["variant"] == "none"}
    base_cpu = {r["repeat"]: r["cpu_seconds"] for r in rows if r["variant"] == "none"}
    print(
        f"\n{'variant':<20} {'loop s':>8} {'vs none':>8} {'CPU vs none':>12} {'stall ms':>9} {'bg ms':>7}  (medians; "
        f"'vs none': median of the ratios to the run without checkpoints of the same repeat; CPU: rank 0's process "
        f"CPU time over the loop, likewise; bg = background work per save)"
    )
    for variant in variants:
        runs = [r for r in rows if r["variant"] == variant]
        loop = statistics.median(r["loop_seconds"] for r in runs)
        ratio = statistics.median(r["loop_seconds"] / base[r["repeat"]] for r in runs) if base else float("nan")
        cpu = statistics.median(r["cpu_seconds"] / base_cpu[r["repeat"]] for r in runs) if base_cpu else float("nan")
        stall = [r.get("save_stall", r.get("snapshot_stall")) for r in runs]
        write = [r.get("save_write", r.get("snapshot_write")) for r in runs]
        extra = ""
        if stall[0] is not None:
            extra = f" {1000 * statistics.median(stall):9.1f} {1000 * statistics.median(write):7.1f}"
        goal = f"  (goal {100 * GOAL:.0f}%)" if variant in ("durable/20", "default/20") else ""
        print(f"{variant:<20} {loop:8.2f} {100 * (ratio - 1):+7.1f}% {100 * (cpu - 1):+11.1f}%{extra}{goal}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


@contextlib.contextmanager
def _storage(s3: bool, tmp: Path) -> Iterator[dict[str, Any] | None]:
    """With ``s3``: a moto S3 server on 127.0.0.1 (stopped by process id afterwards) and a bucket on it."""
    if not s3:
        yield None
        return
    import s3fs

    from benchmarks.checkpoint import S3_OPTIONS, start_moto
    from tests.distributed import _kill

    moto, endpoint = start_moto(tmp)
    try:
        options = {"endpoint_url": endpoint, **S3_OPTIONS}
        s3fs.S3FileSystem(**options).mkdir("spot-ckpt-loop")
        print(f"checkpoints to s3://spot-ckpt-loop on a moto server at {endpoint} (pid {moto.pid})", flush=True)
        yield {"bucket": "spot-ckpt-loop", "options": options}
    finally:
        _kill([moto])


if __name__ == "__main__":
    if JOB_ENV in os.environ:
        run(json.loads(os.environ[JOB_ENV]))
    else:
        sys.exit(main())
