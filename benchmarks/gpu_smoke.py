"""GPU smoke test: train the example GPT with spot_pipeline on every visible GPU (NCCL, bf16-mixed).

    python benchmarks/gpu_smoke.py                      # all GPUs, ~100 steps, prints throughput and losses
    python benchmarks/gpu_smoke.py --devices 2 --max-steps 50

It calls ``examples/gpt/train.py``'s ``main`` with ``--accelerator gpu --precision bf16-mixed`` and a
larger model than the CPU demo (d_model 512, 8 blocks, 8 heads, block size 128). Lightning picks
NCCL for CUDA devices and, for more than one device, launches the other ranks by re-running this
script (hence the ``__main__`` guard). Layout: 2 pipeline stages when the GPU count is even, else 1;
data parallelism over the rest; 4 micro-batches per replica and step, schedule 1F1B.

Without CUDA it prints a notice and exits 0. Exit status 1 if the run finished with a non-finite loss.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from anywhere in the repo, like examples/gpt/train.py


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=None, help="GPUs to use (default: all visible)")
    p.add_argument("--pipeline-stages", type=int, default=None, help="P (default: 2 if the GPU count is even, else 1)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument(
        "--batch-size", type=int, default=None, help="global batch (default: a multiple of D x microbatches near 24)"
    )
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--val-every", type=int, default=50)
    p.add_argument("--precision", default="bf16-mixed")
    p.add_argument("--schedule", default="1F1B")
    p.add_argument("--root", default=str(Path(tempfile.gettempdir()) / "lightning-spot-gpu-smoke"))
    p.add_argument("--checkpoint-every", type=int, default=None, help="steps between durable checkpoints")
    p.add_argument("--timeline-steps", type=int, default=2, help="steps traced into ROOT/pipeline_timeline; 0: off")
    p.add_argument("--no-resume", action="store_true", help="start from scratch even if ROOT holds checkpoints")
    p.add_argument(
        "--plain", action="store_true", help="Lightning's own strategy instead: the baseline to compare with"
    )
    p.add_argument(
        "--sync-debug",
        action="store_true",
        help="warn once per code location that makes the host wait for the GPU (torch.cuda.set_sync_debug_mode)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("CUDA is not available; skipping the GPU smoke test.")
        return 0

    n = args.devices or torch.cuda.device_count()
    P = args.pipeline_stages or (2 if n % 2 == 0 and args.n_layer >= 2 else 1)
    if n % P:
        raise SystemExit(f"--pipeline-stages {P} does not divide the device count {n}")
    D, M = n // P, args.microbatches
    # the example's validation split is small (drop_last): keep the default global batch modest
    batch = args.batch_size or D * M * max(1, 24 // (D * M))

    from examples.gpt.train import main as train_main

    if args.sync_debug:  # each place that synchronises is reported once (Python's default warning filter)
        import warnings

        warnings.simplefilter("default")
        torch.cuda.set_sync_debug_mode("warn")

    train_argv = [
        "--accelerator",
        "gpu",
        "--devices",
        str(n),
        "--precision",
        args.precision,
        "--pipeline-stages",
        str(P),
        "--microbatches",
        str(M),
        "--schedule",
        args.schedule,
        "--batch-size",
        str(batch),
        "--d-model",
        str(args.d_model),
        "--n-layer",
        str(args.n_layer),
        "--n-head",
        str(args.n_head),
        "--block-size",
        str(args.block_size),
        "--max-steps",
        str(args.max_steps),
        "--val-every",
        str(args.val_every),
        "--root",
        args.root,
        "--timeline-steps",
        str(args.timeline_steps),
        *(["--checkpoint-every", str(args.checkpoint_every)] if args.checkpoint_every else []),
        *(["--no-resume"] if args.no_resume else []),
        *(["--plain"] if args.plain else []),
    ]
    summary = train_main(train_argv)

    # every rank runs this function (Lightning re-launches the script); report from global rank 0 only
    if int(os.environ.get("NODE_RANK", 0)) == 0 and int(os.environ.get("LOCAL_RANK", 0)) == 0:
        sps = summary.get("samples_per_sec", float("nan"))
        tps = summary.get("tokens_per_sec", float("nan"))
        print(
            f"gpu_smoke: {n} x {torch.cuda.get_device_name(0)}, "
            f"{'plain Lightning' if args.plain else f'layout P{P}xD{D}'}, {M} micro-batches, "
            f"{args.schedule}, {args.precision}, global batch {batch} x {args.block_size} tokens, "
            f"d_model {args.d_model}, {args.n_layer} layers, {args.max_steps} steps"
        )
        print(
            f"gpu_smoke: throughput {tps:,.0f} tokens/s ({sps:,.1f} samples/s), "
            f"{summary.get('step_seconds', float('nan')) * 1000:.1f} ms/step, "
            f"MFU {100 * summary.get('mfu', float('nan')):.1f}% (6 x parameters x tokens, of the dense bf16 peak), "
            f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"
        )
        losses = {k: summary[k] for k in ("train_loss", "val_loss", "val_ppl") if k in summary}
        print("gpu_smoke: final " + ", ".join(f"{k} {v:.4f}" for k, v in losses.items()))
        if "train_loss" not in summary or not math.isfinite(summary["train_loss"]):
            print("gpu_smoke: FAILED (no finite training loss)")
            return 1
        print("gpu_smoke: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
