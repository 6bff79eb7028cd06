"""Pipelines of mixed depths vs uniform layouts: samples/s on W processes, measured — on CPU, gloo.

The model is ``benchmarks/planner.py``'s uneven residual MLP (the first block costs 12x the last ones),
AdamW, global batch ``--batch``. For each world size of ``--worlds`` the script measures (rank 0's
median step time, ``PipelineThroughput``):

- every uniform layout P x D of W (several micro-batch counts, 1F1B and GPipe, balanced cuts);
- pipelines of mixed depths (``pipeline_stages=[2, 3]`` ...: the closest-depth mixes of W, balanced cuts,
  the micro-batches split by predicted speed);
- what ``pipeline_stages="auto"`` (and every other setting "auto") picks, with its prediction;

and prints each one's samples/s, the best uniform layout against the best mixed one, and the planner's
pick against both. ``--device-memory`` caps the memory the planner and the cuts may use per process, as a
model too large for one device would (``--min-depth 2`` then leaves out layouts with a pipeline of depth 1).

Usage::

    python benchmarks/mixed_layouts.py                       # W=3 and W=5, no memory cap
    python benchmarks/mixed_layouts.py --worlds 5 --device-memory 150MB --min-depth 2
    python benchmarks/mixed_layouts.py --quick

W=5 runs five processes on this machine's two cores: the figures say how the layouts compare when the
processes share cores, which the planner models (``Hardware.compute_slowdown``), not how GPUs would do.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.pipeline_throughput import JobFailed  # noqa: E402
from benchmarks.planner import JOB_ENV, run_job, sweep_layouts, worker  # noqa: E402


def mixes(world: int, layers: int, min_depth: int, count: int) -> list[list[int]]:
    from lightning_spot.planning.mixed import depth_mixes

    return [m for m in depth_mixes(world, layers) if min(m) >= min_depth][:count]


def label(r: dict[str, Any]) -> str:
    m = "+".join(map(str, r["pipeline_microbatches"])) if r["pipeline_microbatches"] else r["microbatches"]
    return f"{r['layout']} M={m} {r['schedule']}"


def world_report(world: int, uniform: list[dict], mixed: list[dict], auto: dict) -> list[str]:
    lines = [f"W={world}", "    layout                         cuts                  ms/step  samples/s  predicted"]
    for r in [*uniform, *mixed, auto]:
        cuts = " | ".join(str(c) for c in r["pipeline_cuts"]) if r["pipeline_cuts"] else str(r["cuts"])
        predicted = f"{r['predicted'] * 1000:8.1f} ms" if r.get("predicted") else "        -"
        tag = "  (planner)" if r is auto else ""
        lines.append(
            f"    {label(r):<31}{cuts:<22}{r['measured'] * 1000:7.1f}  {r['samples_per_second']:9.1f}  {predicted}{tag}"
        )
    best_u = max(uniform, key=lambda r: r["samples_per_second"]) if uniform else None
    best_m = max(mixed, key=lambda r: r["samples_per_second"]) if mixed else None
    if best_u and best_m:
        lines.append(
            f"    best mixed {label(best_m)} vs best uniform {label(best_u)}: "
            f"{best_m['samples_per_second'] / best_u['samples_per_second']:.2f}x samples/s"
        )
    best = max((r for r in (best_u, best_m) if r), key=lambda r: r["samples_per_second"])
    lines.append(
        f"    planner picked {label(auto)}: {auto['samples_per_second']:.1f} samples/s, "
        f"{auto['samples_per_second'] / best['samples_per_second']:.2f}x the best measured ({label(best)})"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", default="3,5")
    parser.add_argument("--batch", type=int, default=60, help="global batch (60: divisible by 2, 3, 4 and 5)")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--hidden", default="6144,3072,512,512,512,512,512,512")
    parser.add_argument("--microbatches", default="1,2,4,6,10,12,20", help="micro-batch counts tried")
    parser.add_argument("--mixes", type=int, default=2, help="mixes of depths tried per world size")
    parser.add_argument("--device-memory", help="memory per process for the planner and the cuts (e.g. 150MB)")
    parser.add_argument("--min-depth", type=int, default=1, help="leave out layouts with shallower pipelines")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.microbatches, args.mixes = 3, 2, "2,6", 1
    hidden = [int(h) for h in args.hidden.split(",")]
    totals = [int(m) for m in args.microbatches.split(",")]
    report, everything = [], {}
    with tempfile.TemporaryDirectory(prefix="spot-mixed-bench-") as tmp:
        out = Path(tmp)
        for world in (int(w) for w in args.worlds.split(",")):
            base = {
                "world": world,
                "batch": args.batch,
                "width": args.width,
                "hidden": hidden,
                "steps": args.steps,
                "warmup": args.warmup,
                "seed": 1234,
                "cache": str(out / f"profiles-{world}"),
                "trace": None,
                "timeout": args.timeout,
                "ac": False,
                "device_memory": args.device_memory,
            }
            try:
                print(f"W={world}: uniform layouts", flush=True)
                uniform = [
                    run_job(base, out, f"w{world}-P{p}-M{m}-{s}", P=p, M=m, schedule=s, partition="balanced")
                    for p, m, s in sweep_layouts(world, args.batch, totals)
                    if p >= args.min_depth
                ]
                print(f"W={world}: pipelines of mixed depths", flush=True)
                mixed = []
                for depths in mixes(world, len(hidden), args.min_depth, args.mixes):
                    least = sum(depths)
                    for m in (t for t in totals if t >= least and args.batch % t == 0):
                        tag = f"w{world}-{'+'.join(map(str, depths))}-M{m}"
                        mixed.append(run_job(base, out, tag, P=depths, M=m, schedule="1F1B", partition="balanced"))
                print(f"W={world}: the planner's pick", flush=True)
                auto = run_job(
                    base, out, f"w{world}-auto", P="auto", M="auto", schedule="auto", partition="auto", ac=None
                )
            except JobFailed as err:
                print(f"FAILED: {err}", file=sys.stderr)
                return 1
            report += [*world_report(world, uniform, mixed, auto), ""]
            everything[world] = {"uniform": uniform, "mixed": mixed, "auto": auto}
    memory = f", {args.device_memory} per process" if args.device_memory else ""
    print(
        f"model: {len(hidden)} residual MLP blocks, width {args.width}, hidden {hidden}; global batch {args.batch}"
        f"{memory}; {args.steps} timed steps (median of rank 0); no thread settings (the strategy sizes them)\n"
    )
    print("\n".join(report))
    if args.json:
        args.json.write_text(json.dumps(everything, indent=2))
    return 0


if __name__ == "__main__":
    if JOB_ENV in os.environ:
        worker()
    else:
        sys.exit(main())
