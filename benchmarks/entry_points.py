"""Throughput of the example GPT through every way a user starts it, on the same layout.

    python benchmarks/entry_points.py                 # P2xD2 1F1B M=4 on 4 CPU processes, 24 steps, 3 rounds
    python benchmarks/entry_points.py --repeats 1 --max-steps 40

The ways (none sets thread counts; the environment is whatever this script was started with):

* ``demo``: ``bash scripts/quickstart.sh demo`` (the example with its default two-step timeline);
* ``script``: ``python examples/gpt/train.py --timeline-steps 0`` (Lightning's launcher starts the ranks);
* ``cli``: ``lightning-spot fit --config examples/gpt/config.yaml`` with the strategy fixed to the same layout;
* ``torchrun``: ``lightning-spot run --nproc-per-node 4 examples/gpt/train.py --timeline-steps 0``;
* ``stream``: the script with ``--stream``: the same text as token shards in a local directory, read as a stream
  (global-stream mode: every replica reads the whole stream). ``--ways script,stream`` compares the two.
* ``litdata``: the script with ``--litdata``: the same windows written by LitData's ``optimize``, each replica
  reading its own shard (sharded mode). ``--ways script,stream,litdata`` compares the three.

Each prints the ``PipelineThroughput`` line; the table shows the median samples/s per way over the
rounds (ways alternate order between rounds) and each way against the median of all of them.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
THROUGHPUT = re.compile(r"throughput \((\S+) (\S+) M=(\d+)\): ([\d.]+) samples/s")
WAYS = ("demo", "script", "cli", "torchrun")  # and "stream", "litdata" on request


def command(way: str, root: Path, steps: int) -> list[str]:
    python = sys.executable
    exe = str(Path(python).parent / "lightning-spot")
    common = ["--max-steps", str(steps), "--no-resume", "--root", str(root), "--val-every", str(10 * steps)]
    if way == "demo":
        return ["bash", "scripts/quickstart.sh", "demo", *common]
    if way in ("script", "stream", "litdata"):
        stream = [f"--{way}"] if way != "script" else []
        return [python, "examples/gpt/train.py", *common, "--timeline-steps", "0", *stream]
    if way == "torchrun":
        return [exe, "run", "--nproc-per-node", "4", "examples/gpt/train.py", *common, "--timeline-steps", "0"]
    config = root / "config.yaml"
    text = (REPO / "examples/gpt/config.yaml").read_text()
    text = text.replace(
        "  strategy: spot_pipeline\n",
        "  strategy:\n    class_path: lightning_spot.SpotPipelineStrategy\n"
        "    init_args: {pipeline_stages: 2, microbatches: 4, schedule: 1F1B}\n",
    )
    config.write_text(text)
    return [
        exe,
        "fit",
        "--config",
        str(config),
        f"--trainer.max_steps={steps}",
        f"--model.max_steps={steps}",
        f"--trainer.val_check_interval={10 * steps}",
        f"--trainer.default_root_dir={root}",  # a fresh run directory: nothing to resume
    ]


def run(way: str, steps: int, timeout: float) -> tuple[float, str]:
    root = Path(tempfile.mkdtemp(prefix=f"spot-entry-{way}-"))
    try:
        proc = subprocess.run(
            command(way, root, steps), cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False
        )
        out = proc.stdout + proc.stderr
        found = THROUGHPUT.findall(out)
        if proc.returncode != 0 or not found:
            raise RuntimeError(f"{way} failed (exit {proc.returncode}):\n{out[-3000:]}")
        layout, schedule, m, samples = found[-1]
        return float(samples), f"{layout} {schedule} M={m}"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=24)
    p.add_argument("--ways", default=",".join(WAYS))
    p.add_argument("--timeout", type=float, default=300)
    args = p.parse_args(argv)
    ways = [w for w in args.ways.split(",") if w]
    print(
        f"example GPT, P2xD2 1F1B M=4 on 4 processes, {args.max_steps} steps, {os.cpu_count()} CPUs, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'not set')}",
        flush=True,
    )
    results: dict[str, list[float]] = {w: [] for w in ways}
    layouts: dict[str, str] = {}
    for rep in range(args.repeats):
        for way in ways if rep % 2 == 0 else list(reversed(ways)):
            samples, layout = run(way, args.max_steps, args.timeout)
            results[way].append(samples)
            layouts[way] = layout
            print(f"[round {rep + 1}] {way:<9} {samples:7.1f} samples/s ({layout})", flush=True)
    medians = {w: statistics.median(v) for w, v in results.items()}
    middle = statistics.median(medians.values())
    print(f"\n{'way':<9} {'layout':<16} {'samples/s (median)':>19} {'all rounds':>26} {'vs median of ways':>18}")
    for way in ways:
        rounds = ", ".join(f"{v:.0f}" for v in results[way])
        print(f"{way:<9} {layouts[way]:<16} {medians[way]:>19.1f} {rounds:>26} {medians[way] / middle:>18.3f}")
    spread = max(medians.values()) / min(medians.values())
    print(f"\nfastest / slowest way: {spread:.3f} (goal: within 10%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
