"""Cost of ``SpotCheckpoint``: training stall of async checkpoints, and save/restore speed vs plain fsspec.

Two measurements, both real runs:

(a) **Stall.** The same ``TinyGPT`` (d_model 512, 8 blocks, byte vocabulary by default: about 25 M
    parameters, ~0.3 GB of weights + Adam state) is trained on synthetic random tokens under
    ``SpotPipelineStrategy(pipeline_stages=2)`` on 4 CPU processes (P2xD2, gloo) three times:
    without checkpoints, with ``SpotCheckpoint(every_n_train_steps=N)`` (async, the default) to a
    local directory, and to an S3 bucket on a moto server that this script starts on 127.0.0.1
    (``--no-s3`` skips it); each twice, in alternating order (``--train-repeats``; medians shown).
    Training time is taken on rank 0 by a callback: ``on_train_start`` to the end of the last step
    (``on_train_batch_end``), and to ``on_train_end`` after ``SpotCheckpoint`` has waited for the
    last upload to commit. Reported: both times, the wall-time overhead over the
    run without checkpoints, the callback's own stall figure (``summary()["stall_fraction"]``: time
    training was blocked by saves / training time; goal < 2%), for rank 0 and the worst rank, and
    the mean background write time per save.

(b) **Throughput.** In this process (one rank, no process group), a state of the same model
    (weights + AdamW state, as ``SpotCheckpoint`` would write it) is saved with ``write_checkpoint``
    (DCP shards + CRC32C + RNG file + manifest) to local disk and to S3, and the produced files'
    bytes are uploaded again with a plain ``fs.pipe`` into another prefix; restore is
    ``lightning_spot.load_full_state_dict`` (verifies every file's CRC32C as it reads) against a plain
    ``fs.cat`` of the same files. Also shown, without a goal: ``load_checkpoint`` (the full
    training-state restore into a model and optimizer). Every measurement is repeated and the median
    is reported as MB/s (MB = 10^6 bytes of the checkpoint's files); the ratio is spot time / plain
    time (goal: within 1.5x).

The default interval (10 steps, ~10 s here) is longer than one upload of the ~0.3 GB state to the
local moto server (~7 s on 2 shared cores), as a real configuration would be; with uploads slower
than the interval every save first waits for the previous one (``--every 5`` shows that case).

The run without checkpoints is the baseline; the callback's ``save_on_train_end`` coincides with the
last periodic save when ``--steps`` is a multiple of ``--every``.

The script is its own launcher, like ``pipeline_throughput.py`` (whose helpers it imports): for (a)
it starts 4 worker processes of itself with the env-var protocol Lightning uses for externally
launched processes (``OMP_NUM_THREADS=1`` unless set) and collects every rank's JSON result.

Usage::

    python benchmarks/checkpoint.py                     # default: d512 x 8 layers, 40 steps, save every 10, local + S3
    python benchmarks/checkpoint.py --quick             # smoke run: small model, 6 steps, save every 2, one run each
    python benchmarks/checkpoint.py --no-s3 --json ckpt.json
    python benchmarks/checkpoint.py --steps 60 --every 10 --train-repeats 3 --io-repeats 5

On a 2-core machine the 4 training processes, their background writer threads and the moto server
share the same cores, so the wall-time overhead includes CPU contention from serialising, CRC32C and
(for S3) HTTP that happens in the background; the stall figure is only the time the training loop
itself was blocked. Local-disk figures go through the page cache (no fsync on either side).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # for examples.gpt.model and benchmarks.pipeline_throughput

from benchmarks.pipeline_throughput import JobFailed, model_hparams, run_ranks, synthetic_dataset  # noqa: E402
from tests.distributed import _kill, free_port  # noqa: E402

JOB_ENV = "SPOT_CKPT_BENCH_JOB"
P, D = 2, 2  # the layout of part (a)
S3_OPTIONS = {"key": "testing", "secret": "testing"}
STALL_GOAL = 0.02
RATIO_GOAL = 1.5


# ============================================================================= worker (a)
def run_train(job: dict[str, Any]) -> dict[str, Any]:
    """One rank of one training run; returns this rank's figures."""
    import lightning as L
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from examples.gpt.model import TinyGPT
    from lightning_spot import SpotCheckpoint, SpotPipelineStrategy

    class BenchGPT(TinyGPT):
        """TinyGPT with a bare training step (no perplexity metric, no logging)."""

        def training_step(self, batch: Any, batch_idx: int):
            x, y = batch
            return F.cross_entropy(self(x).flatten(0, 1).float(), y.flatten())

    class TrainTimer(L.Callback):
        """Training time as seen by the loop. Listed after SpotCheckpoint, so its hooks run after the
        checkpoint's: the last step's time includes that step's save stall, ``on_train_end`` the wait
        for the last upload to commit."""

        start = last_step_end = end = 0.0

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.start = time.monotonic()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            self.last_step_end = time.monotonic()

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.end = time.monotonic()

    L.seed_everything(job["seed"], verbose=False)
    model = BenchGPT(**model_hparams(job))
    loader = DataLoader(synthetic_dataset(job), batch_size=job["batch_size"], shuffle=False, drop_last=True)
    callbacks: list[L.Callback] = []
    spot = None
    if job["target"] != "none":
        spot = SpotCheckpoint(
            dirpath=job["dirpath"],
            every_n_train_steps=job["every"],
            keep_last=job["keep_last"],
            storage_options=job.get("storage_options"),
        )
        callbacks.append(spot)
    timer = TrainTimer()
    callbacks.append(timer)
    strategy = SpotPipelineStrategy(pipeline_stages=P, microbatches=job["microbatches"], schedule="1F1B")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=P * D,
        strategy=strategy,
        max_steps=job["steps"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=job["root"],
        callbacks=callbacks,
    )
    trainer.fit(model, train_dataloaders=loader)
    if str(strategy.layout) != f"P{P}xD{D}":
        raise RuntimeError(f"strategy picked layout {strategy.layout}, expected P{P}xD{D}")
    out: dict[str, Any] = {
        "rank": int(os.environ["RANK"]),
        "global_step": trainer.global_step,
        "train_seconds": timer.last_step_end - timer.start,
        "train_seconds_with_final_commit": timer.end - timer.start,
    }
    if spot is not None:
        out["spot"] = {
            "url": spot.url,
            "saves": spot.saves,
            "summary": spot.summary(),
            "train_seconds": spot._train_seconds,
        }
    return out


def worker() -> None:
    job = json.loads(os.environ[JOB_ENV])
    result = run_train(job)
    Path(f"{job['result']}.rank{os.environ['RANK']}.json").write_text(json.dumps(result))


# =========================================================================== launcher (a)
def launch(job: dict[str, Any], world: int, log_dir: Path, timeout: float) -> list[dict[str, Any]]:
    """Start ``world`` workers of this script for ``job``; every rank's result, by rank."""
    results = [Path(f"{job['result']}.rank{r}.json") for r in range(world)]
    for path in results:
        path.unlink(missing_ok=True)
    run_ranks(world, {JOB_ENV: json.dumps(job)}, log_dir / job["tag"], timeout)
    missing = [str(p) for p in results if not p.exists()]
    if missing:
        raise JobFailed(f"{job['tag']}: no result from {missing} (logs in {log_dir})")
    return [json.loads(p.read_text()) for p in results]


# ================================================================================== S3
def start_moto(log_dir: Path) -> tuple[subprocess.Popen, str]:
    """moto's standalone S3 server on 127.0.0.1 in its own session (stopped by pid with ``_kill``)."""
    port = free_port()
    log = open(log_dir / "moto.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-c", "from moto.server import main; main()", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log.close()
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                _kill([proc])
                raise RuntimeError(f"the moto S3 server did not start (see {log_dir / 'moto.log'})") from None
            time.sleep(0.2)


# ========================================================================= model figures
def state_size(hp: dict[str, Any]) -> dict[str, float]:
    """Parameters and the bytes of weights + AdamW moments (fp32) of the benchmark model."""
    import torch

    from examples.gpt.model import TinyGPT

    with torch.device("meta"):
        model = TinyGPT(**hp)
        model.configure_model()
    n = sum(p.numel() for p in model.parameters())
    return {"params": n, "weights_mb": 4 * n / 1e6, "adam_mb": 8 * n / 1e6, "total_mb": 12 * n / 1e6}


# ============================================================================= part (a)
def part_a(args: argparse.Namespace, tmp: Path, log_dir: Path, s3: dict[str, Any] | None) -> list[dict[str, Any]]:
    from lightning_spot.checkpoint.durable.storage import MANIFEST, Storage

    targets = ["none", "local"] + (["s3"] if s3 else [])
    rows: list[dict[str, Any]] = []
    for rep in range(args.train_repeats):
        order = targets if rep % 2 == 0 else list(reversed(targets))
        for target in order:
            tag = f"a-{target}-{rep}"
            job: dict[str, Any] = {
                "tag": tag,
                "target": target,
                "steps": args.steps,
                "warmup": 0,
                "every": args.every,
                "keep_last": args.keep_last,
                "batch_size": args.batch_size,
                "microbatches": args.microbatches,
                "d_model": args.d_model,
                "n_layer": args.n_layer,
                "n_head": args.n_head,
                "block_size": args.block_size,
                "seed": args.seed,
                "root": str(tmp / tag),
                "result": str(tmp / tag),
            }
            if target == "local":
                job["dirpath"] = str(tmp / tag / "ckpt")
            elif target == "s3":
                assert s3 is not None
                job["dirpath"] = f"s3://{s3['bucket']}/{tag}"
                job["storage_options"] = s3["options"]
            t0 = time.monotonic()
            ranks = launch(job, P * D, log_dir, args.timeout)
            row: dict[str, Any] = {
                "target": target,
                "repeat": rep,
                "job_seconds": time.monotonic() - t0,
                "ranks": ranks,
            }
            r0 = ranks[0]
            row["train_seconds"] = r0["train_seconds"]
            row["train_seconds_with_final_commit"] = r0["train_seconds_with_final_commit"]
            if target != "none":
                storage = Storage(job["dirpath"], job.get("storage_options"))
                committed = storage.committed()
                manifests = {rel: storage.read_json(f"{rel}/{MANIFEST}") for rel in committed}
                manifest = manifests[committed[-1]]
                saves0 = r0["spot"]["saves"]
                row.update(
                    saves=len(saves0),
                    committed=committed,
                    checkpoint_bytes=manifest["bytes"] + len(json.dumps(manifest, indent=1, sort_keys=True)),
                    checkpoint_files=len(manifest["files"]) + 1,
                    tensor_bytes=sum(r["spot"]["saves"][-1]["bytes"] for r in ranks),
                    stall_fraction_rank0=r0["spot"]["summary"]["stall_fraction"],
                    stall_fraction_max=max(r["spot"]["summary"]["stall_fraction"] for r in ranks),
                    stall_seconds_rank0=r0["spot"]["summary"]["stall_seconds"],
                    stall_per_save=[s["stall_seconds"] for s in saves0],
                    write_per_save=[s.get("write_seconds") for s in saves0],
                    mean_write_seconds=statistics.mean(s["write_seconds"] for s in saves0 if "write_seconds" in s),
                    # rank 0's split of the stall of the retained checkpoints, from their manifests
                    retained_timings={m["step"]: m["timings"] for m in manifests.values()},
                )
                storage.delete("")  # free the disk / the moto server's memory
            rows.append(row)
            line = f"  {target:<6} run {rep + 1}: train {row['train_seconds']:6.1f}s"
            if target != "none":
                line += (
                    f", +final commit {row['train_seconds_with_final_commit']:6.1f}s, {row['saves']} saves, "
                    f"stall {100 * row['stall_fraction_rank0']:.2f}% (rank 0) / {100 * row['stall_fraction_max']:.2f}% (worst rank), "
                    f"write {row['mean_write_seconds']:.2f}s/save"
                )
            print(line + f"  (job {row['job_seconds']:.0f}s)", flush=True)
    return rows


def summarize_a(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per target: medians over repeats, overhead vs the run without checkpoints."""
    out: dict[str, dict[str, Any]] = {}
    for target in dict.fromkeys(r["target"] for r in rows):
        runs = [r for r in rows if r["target"] == target]
        s: dict[str, Any] = {
            "runs": len(runs),
            "train_seconds": statistics.median(r["train_seconds"] for r in runs),
            "train_seconds_with_final_commit": statistics.median(r["train_seconds_with_final_commit"] for r in runs),
        }
        if target != "none":
            for key in ("stall_fraction_rank0", "stall_fraction_max", "mean_write_seconds", "stall_seconds_rank0"):
                s[key] = statistics.median(r[key] for r in runs)
            s["saves"] = runs[0]["saves"]
            s["checkpoint_bytes"] = runs[0]["checkpoint_bytes"]
            s["mean_stall_seconds"] = statistics.median(statistics.mean(r["stall_per_save"]) for r in runs)
        out[target] = s
    base = out["none"]
    for s in out.values():
        s["overhead"] = s["train_seconds"] / base["train_seconds"] - 1
        s["overhead_with_final_commit"] = s["train_seconds_with_final_commit"] / base["train_seconds"] - 1
    return out


def print_a(summary: dict[str, dict[str, Any]]) -> None:
    header = (
        f"{'target':<7} {'saves':>5} {'train s':>8} {'overhead':>9} {'+commit s':>10} {'overhead':>9} "
        f"{'stall/save s':>12} {'stall% r0':>10} {'stall% max':>11} {'write s/save':>13} {'ckpt MB':>8}"
    )
    print(header)
    print("-" * len(header))
    for target, s in summary.items():
        if target == "none":
            print(
                f"{target:<7} {0:>5} {s['train_seconds']:>8.1f} {'-':>9} {s['train_seconds_with_final_commit']:>10.1f} "
                f"{'-':>9} {'-':>12} {'-':>10} {'-':>11} {'-':>13} {'-':>8}"
            )
            continue
        print(
            f"{target:<7} {s['saves']:>5} {s['train_seconds']:>8.1f} {100 * s['overhead']:>+8.1f}% "
            f"{s['train_seconds_with_final_commit']:>10.1f} {100 * s['overhead_with_final_commit']:>+8.1f}% "
            f"{s['mean_stall_seconds']:>12.3f} {100 * s['stall_fraction_rank0']:>9.2f}% {100 * s['stall_fraction_max']:>10.2f}% "
            f"{s['mean_write_seconds']:>13.2f} {s['checkpoint_bytes'] / 1e6:>8.1f}"
        )


# ============================================================================= part (b)
def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    value = fn()
    return time.perf_counter() - t0, value


def part_b(
    args: argparse.Namespace, hp: dict[str, Any], targets: list[tuple[str, str, dict[str, Any]]]
) -> list[dict[str, Any]]:
    """Save / restore of one rank's full state with lightning-spot vs plain fsspec, per target."""
    import torch

    from examples.gpt.model import TinyGPT
    from lightning_spot import load_full_state_dict
    from lightning_spot.checkpoint.durable.read import load_checkpoint
    from lightning_spot.checkpoint.durable.storage import Storage, step_dirname
    from lightning_spot.checkpoint.durable.write import write_checkpoint
    from lightning_spot.checkpoint.flat_optimizer import optimizer_state
    from lightning_spot.checkpoint.payload import split_checkpoint

    def model_and_optimizer(seed: int) -> tuple[Any, Any]:
        torch.manual_seed(seed)
        model = TinyGPT(**hp)
        model.configure_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()  # fills exp_avg / exp_avg_sq
        opt.zero_grad(set_to_none=True)
        return model, opt

    model, opt = model_and_optimizer(args.seed)
    checkpoint = {
        "state_dict": model.state_dict(),
        "optimizer_states": [optimizer_state(model, opt)],
        "global_step": 1,
        "epoch": 0,
    }
    payload = split_checkpoint(checkpoint, copy=False, with_lightning=True)
    info = {
        "step": 1,
        "epoch": 0,
        "layout": {"pipeline_stages": 1, "data_parallel": 1, "world_size": 1},
        "data": {"global_batch": 0, "samples_consumed": 0},
    }
    expected_weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    other_model, other_opt = model_and_optimizer(args.seed + 1)  # for load_checkpoint: different values to overwrite
    rel = step_dirname(1)
    rows = []
    for name, base, options in targets:
        times: dict[str, list[float]] = {
            "save": [],
            "plain_save": [],
            "restore": [],
            "plain_restore": [],
            "restore_full": [],
        }
        blobs: dict[str, bytes] = {}  # the files of the first spot save: what the plain upload sends
        for rep in range(args.io_repeats):
            spot = Storage(f"{base}/spot-{rep}", options)
            plain = Storage(f"{base}/plain-{rep}", options)
            if spot.is_local:
                spot.fs.makedirs(spot.root, exist_ok=True)
                plain.fs.makedirs(plain.path_of(rel), exist_ok=True)

            def spot_save() -> None:
                t, _ = _timed(lambda: write_checkpoint(spot, rel, payload, info=info))
                times["save"].append(t)
                if not blobs:
                    blobs.update({n: spot.fs.cat_file(spot.path_of(rel, n)) for n in sorted(spot.sizes(rel))})

            def plain_save() -> None:
                t, _ = _timed(lambda: plain.fs.pipe({plain.path_of(rel, n): data for n, data in blobs.items()}))
                times["plain_save"].append(t)

            def spot_restore() -> None:
                t, weights = _timed(lambda: load_full_state_dict(spot.url_of(rel), options))
                times["restore"].append(t)
                if rep == 0:
                    assert weights.keys() == expected_weights.keys()
                    assert all(torch.equal(weights[k], v) for k, v in expected_weights.items()), (
                        "restored weights differ"
                    )

            def plain_restore() -> None:
                t, got = _timed(lambda: spot.fs.cat(paths))
                times["plain_restore"].append(t)
                assert sum(len(b) for b in got.values()) == sum(sizes.values())

            # alternate which goes first; the first plain upload needs the bytes of a spot save
            for fn in (spot_save, plain_save) if rep % 2 == 0 or not blobs else (plain_save, spot_save):
                fn()
            plain._fresh(plain.path_of(rel))
            assert plain.sizes(rel) == {n: len(b) for n, b in blobs.items()}, "plain upload incomplete"
            sizes = spot.sizes(rel)
            paths = [spot.path_of(rel, n) for n in sorted(sizes)]
            for fn in (spot_restore, plain_restore) if rep % 2 == 0 else (plain_restore, spot_restore):
                fn()
            t, _ = _timed(lambda: load_checkpoint(spot.url_of(rel), options, other_model, [other_opt]))
            times["restore_full"].append(t)
            if rep == 0:
                assert all(torch.equal(other_model.state_dict()[k], v) for k, v in expected_weights.items())
            spot.delete("")
            plain.delete("")
        nbytes, nfiles = sum(len(b) for b in blobs.values()), len(blobs)
        crc = []
        for _ in range(args.io_repeats):  # context: what checksumming alone costs on this machine
            t, _ = _timed(lambda: [zlib.crc32(b) for b in blobs.values()])
            crc.append(t)
        times["crc32_only"] = crc
        blobs.clear()
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {
            "target": name,
            "bytes": nbytes,
            "files": nfiles,
            "repeats": args.io_repeats,
            "seconds": times,
            "median_seconds": med,
            "save_mb_s": nbytes / 1e6 / med["save"],
            "plain_save_mb_s": nbytes / 1e6 / med["plain_save"],
            "restore_mb_s": nbytes / 1e6 / med["restore"],
            "plain_restore_mb_s": nbytes / 1e6 / med["plain_restore"],
            "restore_full_mb_s": nbytes / 1e6 / med["restore_full"],
            "crc32_mb_s": nbytes / 1e6 / med["crc32_only"],
            "save_ratio": med["save"] / med["plain_save"],
            "restore_ratio": med["restore"] / med["plain_restore"],
            "restore_full_ratio": med["restore_full"] / med["plain_restore"],
        }
        rows.append(row)
        print(
            f"  {name:<6} {nbytes / 1e6:.1f} MB in {nfiles} files: save {row['save_mb_s']:.0f} MB/s vs plain "
            f"{row['plain_save_mb_s']:.0f} MB/s; restore {row['restore_mb_s']:.0f} MB/s vs plain {row['plain_restore_mb_s']:.0f} MB/s",
            flush=True,
        )
    return rows


def print_b(rows: list[dict[str, Any]]) -> None:
    header = f"{'target':<7} {'operation':<34} {'spot MB/s':>10} {'plain MB/s':>11} {'spot s':>8} {'plain s':>8} {'spot/plain':>11}"
    print(header)
    print("-" * len(header))
    for r in rows:
        m = r["median_seconds"]
        print(
            f"{r['target']:<7} {'save (write_checkpoint vs pipe)':<34} {r['save_mb_s']:>10.1f} {r['plain_save_mb_s']:>11.1f} "
            f"{m['save']:>8.3f} {m['plain_save']:>8.3f} {r['save_ratio']:>10.2f}x"
        )
        print(
            f"{r['target']:<7} {'restore (load_full_state_dict vs cat)':<34} {r['restore_mb_s']:>10.1f} "
            f"{r['plain_restore_mb_s']:>11.1f} {m['restore']:>8.3f} {m['plain_restore']:>8.3f} {r['restore_ratio']:>10.2f}x"
        )
        print(
            f"{r['target']:<7} {'  (load_checkpoint: model+optim)':<34} {r['restore_full_mb_s']:>10.1f} "
            f"{r['plain_restore_mb_s']:>11.1f} {m['restore_full']:>8.3f} {m['plain_restore']:>8.3f} {r['restore_full_ratio']:>10.2f}x"
        )
        print(
            f"{r['target']:<7} {'  (zlib.crc32 of the bytes alone)':<34} {r['crc32_mb_s']:>10.1f} {'':>11} {m['crc32_only']:>8.3f}"
        )


# ================================================================================ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: d_model 128 x 4 layers, 6 steps, save every 2")
    p.add_argument(
        "--s3", action=argparse.BooleanOptionalAction, default=True, help="also measure S3 on a local moto server"
    )
    p.add_argument("--json", metavar="PATH", help="also save the results as JSON")
    p.add_argument("--d-model", type=int, default=None, help="default 512 (--quick 128)")
    p.add_argument("--n-layer", type=int, default=None, help="default 8 (--quick 4)")
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8, help="global batch; a multiple of D x microbatches")
    p.add_argument(
        "--microbatches", type=int, default=2, help="micro-batches per replica and step (>= 2 for 1F1B on P2)"
    )
    p.add_argument("--steps", type=int, default=None, help="training steps (default 40; --quick 6)")
    p.add_argument(
        "--every", type=int, default=None, help="SpotCheckpoint(every_n_train_steps=...) (default 10; --quick 2)"
    )
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument(
        "--train-repeats",
        type=int,
        default=None,
        help="training runs per target in (a), in alternating order; medians are shown (default 2; --quick 1)",
    )
    p.add_argument("--io-repeats", type=int, default=None, help="repeats of each measurement in (b) (default 3)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--timeout", type=float, default=300.0, help="seconds per training run before its workers are killed"
    )
    p.add_argument("--log-dir", help="keep the workers' and moto's logs here (default: a temporary folder)")
    args = p.parse_args(argv)
    args.d_model = args.d_model or (128 if args.quick else 512)
    args.n_layer = args.n_layer or (4 if args.quick else 8)
    args.steps = args.steps or (6 if args.quick else 40)
    args.every = args.every or (2 if args.quick else 10)
    args.train_repeats = args.train_repeats or (1 if args.quick else 2)
    args.io_repeats = args.io_repeats or 3
    problems = []
    if args.batch_size % (D * args.microbatches):
        problems.append(f"batch size {args.batch_size} is not a multiple of D x microbatches = {D * args.microbatches}")
    if args.microbatches < P:
        problems.append(f"1F1B needs microbatches >= {P}")
    if args.n_layer < P:
        problems.append(f"{args.n_layer} layers cannot fill {P} stages")
    if args.d_model % args.n_head:
        problems.append("d_model must be a multiple of n_head")
    if min(args.steps, args.every, args.train_repeats, args.io_repeats, args.keep_last) < 1:
        problems.append("--steps, --every, --train-repeats, --io-repeats and --keep-last must be >= 1")
    if problems:
        raise SystemExit("invalid configuration:\n  " + "\n  ".join(problems))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="spot-ckpt-bench-"))
    log_dir = Path(args.log_dir) if args.log_dir else tmp / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    hp = model_hparams({**vars(args), "warmup": 0})
    size = state_size(hp)
    print(
        f"model: TinyGPT d_model={args.d_model} n_layer={args.n_layer} n_head={args.n_head} vocab=256 block={args.block_size}: "
        f"{size['params'] / 1e6:.2f} M parameters; state = weights {size['weights_mb']:.1f} MB + AdamW moments "
        f"{size['adam_mb']:.1f} MB = {size['total_mb']:.1f} MB (fp32)",
        flush=True,
    )
    print(
        f"(a) P{P}xD{D} on {P * D} CPU processes (gloo), global batch {args.batch_size}, {args.microbatches} micro-batches, "
        f"1F1B, {args.steps} steps; SpotCheckpoint(every_n_train_steps={args.every}, keep_last={args.keep_last}), async; "
        f"targets: none, local{', s3 (moto)' if args.s3 else ''}; {os.cpu_count()} cores, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1 (set by this script)')}",
        flush=True,
    )
    moto = None
    s3: dict[str, Any] | None = None
    failed = False
    results: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "log_dir")},
        "state": size,
    }
    try:
        if args.s3:
            import s3fs

            moto, endpoint = start_moto(log_dir)
            options = {"endpoint_url": endpoint, **S3_OPTIONS}
            bucket = f"spot-bench-{uuid.uuid4().hex[:8]}"
            s3fs.S3FileSystem(**options).mkdir(bucket)
            s3 = {"bucket": bucket, "options": options}
            print(f"moto S3 server at {endpoint} (pid {moto.pid}), bucket {bucket}", flush=True)

        rows_a = part_a(args, tmp, log_dir, s3)
        summary_a = summarize_a(rows_a)
        results["a"] = {"runs": rows_a, "summary": summary_a}
        print()
        print_a(summary_a)
        print(
            "train s: on_train_start -> end of the last step (rank 0); +commit s: -> on_train_end, after the wait for the "
            "last upload; overhead: vs the run without checkpoints; stall: SpotCheckpoint.summary() (time the loop was "
            "blocked by saves / its training time), rank 0 and worst rank; write s/save: background write_checkpoint time"
        )
        for target in summary_a:
            if target != "none":
                run = next(r for r in rows_a if r["target"] == target)
                print(
                    f"  {target} (run 1): stall per save (s) {' '.join(f'{x:.3f}' for x in run['stall_per_save'])}; "
                    f"write per save (s) {' '.join(f'{x:.2f}' if x is not None else '?' for x in run['write_per_save'])}"
                )
                print(
                    f"  {target} (run 1): of the stall (rank 0, retained checkpoints), waiting for the previous upload: "
                    + ", ".join(
                        f"step {step} {t['stall_seconds']:.3f}s of which {t['waited_for_previous_seconds']:.3f}s"
                        for step, t in sorted(run["retained_timings"].items())
                    )
                )

        print(
            f"\n(b) save / restore of one rank's state ({size['total_mb']:.1f} MB of tensors), {args.io_repeats} repeats, medians",
            flush=True,
        )
        targets = [("local", str(tmp / "io"), {})]
        if s3:
            targets.append(("s3", f"s3://{s3['bucket']}/io", s3["options"]))
        with warnings.catch_warnings():  # DCP's note that it runs without a process group (on purpose here)
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            rows_b = part_b(args, hp, targets)
        results["b"] = rows_b
        print()
        print_b(rows_b)
        print("spot/plain: time ratio (1.00x = as fast as plain fsspec); MB = 10^6 bytes of the checkpoint's files")

        # ---------------------------------------------------------------- summary
        ckpt = {t: s for t, s in summary_a.items() if t != "none"}
        worst_stall = max(s["stall_fraction_max"] for s in ckpt.values())
        worst_save = max(r["save_ratio"] for r in rows_b)
        worst_restore = max(r["restore_ratio"] for r in rows_b)
        stall_detail = ", ".join(
            f"{t} {100 * s['stall_fraction_max']:.2f}% (wall-time overhead {100 * s['overhead']:+.1f}%, "
            f"{100 * s['overhead_with_final_commit']:+.1f}% incl. final commit; {s['mean_write_seconds']:.2f}s background write/save)"
            for t, s in ckpt.items()
        )
        io_detail = ", ".join(
            f"{r['target']} save {r['save_ratio']:.2f}x restore {r['restore_ratio']:.2f}x" for r in rows_b
        )
        line = (
            f"checkpoint stall: {100 * worst_stall:.2f}% of training time (goal < {100 * STALL_GOAL:.0f}%); "
            f"save {worst_save:.2f}x and restore {worst_restore:.2f}x plain fsspec (goal within {RATIO_GOAL}x)"
        )
        verdict = {
            "stall": worst_stall < STALL_GOAL,
            "save": worst_save <= RATIO_GOAL,
            "restore": worst_restore <= RATIO_GOAL,
        }
        results["summary"] = {
            "line": line,
            "stall_fraction": worst_stall,
            "save_ratio": worst_save,
            "restore_ratio": worst_restore,
            "goals_met": verdict,
        }
        print("\n" + "=" * 100)
        print(f"stall (worst rank): {stall_detail}")
        print(f"throughput: {io_detail}")
        print(line)
        print("goals: " + ", ".join(f"{k} {'met' if ok else 'MISSED'}" for k, ok in verdict.items()))
    except JobFailed as err:
        failed = True
        results["error"] = str(err)
        print(f"FAILED:\n{err}", file=sys.stderr, flush=True)
    finally:
        if moto is not None:
            _kill([moto])
    print(f"total wall time {time.monotonic() - started:.0f}s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
        print(f"results saved to {args.json}")
    if failed and not args.log_dir:
        print(f"logs kept in {log_dir}", file=sys.stderr)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ and JOB_ENV in os.environ:
        worker()
    else:
        sys.exit(main())
