"""What keeping training state in host memory costs: step time per offload level against none.

The model is ``benchmarks/planner.py``'s uneven residual MLP (AdamW; ~12.6 M parameters, ~200 MB of weights,
gradients and Adam state in fp32), P2xD1 1F1B with 4 micro-batches, global batch ``--batch``, on 2 processes.
Each level runs ``--repeats`` times, alternating with the run without offload; the figure is the ratio of the
medians of rank 0's median step time (``PipelineThroughput``). ``parameters`` runs Harmony's breadth-first
schedule (LoopedBFS, one layer per stage: 4 stages per rank) and is compared with the same schedule without
offload; it also prints the most weight bytes rank 0 had on the device at once, against all of its weights.

On a CPU machine "host" and "device" are the same memory: the figure is the cost of the machinery (the swap of
every parameter to its master and back, the gradient copies), not of PCIe transfers. On a GPU the same script
measures the real cost (``--accelerator gpu``).

Usage::

    python benchmarks/offload.py                 # optimizer, activations, both, parameters
    python benchmarks/offload.py --repeats 5 --steps 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import os  # noqa: E402

from benchmarks.pipeline_throughput import JobFailed  # noqa: E402
from benchmarks.planner import JOB_ENV, run_job, worker  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="optimizer,activations,optimizer+activations,parameters")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--hidden", default="6144,3072,512,512,512,512,512,512")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--accelerator", default="cpu", help="gpu: 2 GPUs, the copies cross PCIe")
    parser.add_argument("--precision", default="32-true", help="e.g. bf16-mixed on GPUs")
    args = parser.parse_args(argv)
    levels = [x for x in args.levels.split(",") if x]
    streamed = any("parameters" in level for level in levels)
    baselines = ["none", *(["none-LoopedBFS"] if streamed else [])]
    times: dict[str, list[float]] = {b: [] for b in baselines} | {level: [] for level in levels}
    weights: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="spot-offload-bench-") as tmp:
        out = Path(tmp)
        base = {
            "world": 2,
            "batch": args.batch,
            "width": args.width,
            "hidden": [int(h) for h in args.hidden.split(",")],
            "steps": args.steps,
            "warmup": args.warmup,
            "seed": 1234,
            "cache": str(out / "profiles"),
            "trace": None,
            "timeout": args.timeout,
            "ac": False,
            "accelerator": args.accelerator,
            "precision": args.precision,
        }
        try:
            for r in range(args.repeats):
                for level in [*baselines, *levels]:
                    offload = None if level.startswith("none") else level.split("+")
                    looped = level == "none-LoopedBFS" or "parameters" in level
                    schedule = {"schedule": "LoopedBFS", "stages_per_rank": 4} if looped else {"schedule": "1F1B"}
                    result = run_job(
                        base, out, f"{level}-{r}", P=2, M=4, partition="uniform", offload=offload, **schedule
                    )
                    times[level].append(result["measured"])
                    weights[level] = result.get("weights")
        except JobFailed as err:
            print(f"FAILED: {err}", file=sys.stderr)
            return 1
    none = statistics.median(times["none"])
    print(
        f"uneven MLP {args.hidden}, width {args.width}, AdamW, P2xD1 1F1B M=4, batch {args.batch}, {args.repeats} runs"
    )
    print(f"  no offload:        {none * 1000:7.1f} ms/step  ({', '.join(f'{t * 1000:.1f}' for t in times['none'])})")
    if streamed:
        looped = statistics.median(times["none-LoopedBFS"])
        runs = ", ".join(f"{x * 1000:.1f}" for x in times["none-LoopedBFS"])
        print(f"  no offload, LoopedBFS x4: {looped * 1000:7.1f} ms/step  ({runs})")
    for level in levels:
        t = statistics.median(times[level])
        runs = ", ".join(f"{x * 1000:.1f}" for x in times[level])
        if "parameters" in level:
            w = weights[level]
            print(
                f"  offload={level!r:<12}{t * 1000:7.1f} ms/step  ({runs}): {t / looped:.3f}x the same schedule "
                f"without offload, {t / none:.3f}x 1F1B; weights on the device at most "
                f"{w['peak_bytes'] / 2**20:.1f} of {w['total_bytes'] / 2**20:.1f} MiB ({w['peak_bytes'] / w['total_bytes']:.0%})"
            )
        else:
            print(f"  offload={level!r:<12}{t * 1000:7.1f} ms/step  ({runs}): {t / none:.3f}x")
    return 0


if __name__ == "__main__":
    if JOB_ENV in os.environ:
        worker()
    else:
        sys.exit(main())
