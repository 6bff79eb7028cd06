"""The strategy's step time on two source trees, in alternating pairs: the honest way to see a change of a few
percent on a noisy machine (single runs of ``pipeline_throughput.py`` scatter by 10% or more).

    git worktree add /tmp/before <commit>                  # the code to compare against
    python benchmarks/ab_strategy.py --before /tmp/before --layout P2xD1 --pairs 6

Each pair runs ``benchmarks/pipeline_throughput.py --impl strategy`` once with ``lightning_spot`` imported from
``BEFORE/src`` and once from this checkout's ``src`` (the order alternates), and prints both ms/step; the summary
is the median of each and the median of the per-pair ratios (after / before).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def step_ms(src: Path, layout: str, model: str, steps: int) -> float:
    """One strategy run's median ms/step, with ``lightning_spot`` imported from ``src``."""
    command = [sys.executable, str(REPO / "benchmarks" / "pipeline_throughput.py"), "--impl", "strategy"]
    command += ["--model", model, "--layouts", layout, "--steps", str(steps)]
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900).stdout
    found = re.search(r"strategy\s+[\d.]+ samples/s\s+([\d.]+) ms/step", out)
    if found is None:
        raise SystemExit(f"no step time in the output of {' '.join(command)}:\n{out[-3000:]}")
    return float(found.group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, required=True, help="a checkout of the code to compare against")
    p.add_argument("--layout", default="P2xD1")
    p.add_argument("--model", default="mlp", choices=("mlp", "gpt"))
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--steps", type=int, default=100)
    args = p.parse_args()
    trees = {"before": args.before.resolve() / "src", "after": REPO / "src"}
    times: dict[str, list[float]] = {name: [] for name in trees}
    for i in range(args.pairs):
        order = list(trees) if i % 2 == 0 else list(reversed(trees))
        for name in order:
            times[name].append(step_ms(trees[name], args.layout, args.model, args.steps))
        print(f"pair {i + 1}: before {times['before'][-1]:.1f} ms, after {times['after'][-1]:.1f} ms", flush=True)
    ratio = statistics.median(a / b for a, b in zip(times["after"], times["before"]))
    before, after = statistics.median(times["before"]), statistics.median(times["after"])
    better = sum(a < b for a, b in zip(times["after"], times["before"]))
    print(
        f"{args.model} {args.layout}: before {before:.2f} ms/step, after {after:.2f} ms/step, after/before {ratio:.3f} "
        f"(median of {args.pairs} pairs; after faster in {better})"
    )


if __name__ == "__main__":
    main()
