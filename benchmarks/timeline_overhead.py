"""What the pipeline timeline costs: step time with the feature absent (torch's own stage methods,
no clocks), present but off (the default: two clock reads per micro-batch for the bubble figure),
and on (every step traced).

Same model, data and layout as ``pipeline_throughput.py`` (TinyGPT, 1F1B); the three modes run in
rotating order for ``--repeats`` rounds and the table shows each mode's median.

    python benchmarks/timeline_overhead.py                      # P2xD1, 5 rounds
    python benchmarks/timeline_overhead.py --layout P2xD2 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.pipeline_throughput import JOB_ENV, JobFailed, launch, parse_layouts, worker  # noqa: E402

MODES = ("absent", "off", "on")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layout", default="P2xD1")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--timeout", type=float, default=300)
    args = p.parse_args(argv)
    ((P, D),) = parse_layouts(args.layout)
    tmp = Path(tempfile.mkdtemp(prefix="spot-timeline-bench-"))
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for rep in range(args.repeats):
        order = MODES[rep % 3 :] + MODES[: rep % 3]
        for mode in order:
            job = {
                "impl": "strategy",
                "P": P,
                "D": D,
                "microbatches": args.microbatches,
                "batch_size": 32,
                "d_model": 256,
                "n_layer": 8,
                "n_head": 4,
                "block_size": 64,
                "warmup": args.warmup,
                "steps": args.steps,
                "seed": 1234,
                "timeline": mode,
                "result": str(tmp / f"{mode}-{rep}.json"),
            }
            try:
                result = launch(job, tmp / "logs", args.timeout)
            except JobFailed as err:
                print(f"FAILED: {err}", file=sys.stderr)
                return 1
            times[mode].append(result["median_step_seconds"])
            print(
                f"round {rep + 1} {mode:<7} {result['median_step_seconds'] * 1000:7.2f} ms/step (median of {args.steps})",
                flush=True,
            )
    base = statistics.median(times["absent"])
    print(f"\n{args.layout}, TinyGPT, 1F1B, {args.microbatches} micro-batches; median over {args.repeats} rounds")
    for mode in MODES:
        m = statistics.median(times[mode])
        print(f"  timeline {mode:<7} {m * 1000:8.2f} ms/step   {(m / base - 1) * 100:+.1f}% vs absent")
    return 0


if __name__ == "__main__":
    if JOB_ENV in os.environ:  # a worker process of a job (the launcher starts this script)
        worker()
    else:
        sys.exit(main())
