"""Survivors keep training (issue 25): how long the other pipelines wait when one is killed, and when it returns.

Runs ``lightning-spot run --replica-groups G --nproc-per-node P`` on ``tests/workers/ft_train.py`` (the test model,
CPU processes over gloo, an embedded torchft lighthouse with its spot defaults: heartbeat 1 s). Pipelines 1..G-1
kill one of their processes (SIGKILL, after the forward, before the gradients reach the others) at the steps given;
each comes back through its torchrun and takes a survivor's state. Pipeline 0 is never killed; from its step
times the script prints, per kill, the seconds from the kill to its next committed step, and per join, the
longest of its steps under way while the joiner restored and ran its first step, beyond its median step time (how long the join stalled it), with
the joiner's restore time and bytes per second.

Usage::

    python benchmarks/ft_recovery.py                                 # 3 pipelines of 1 stage, 5 kills
    python benchmarks/ft_recovery.py --groups 2 --stages 2 --kills 2
    python benchmarks/ft_recovery.py --overhead --groups 2 --stages 2     # per-step cost of the quorum
    python benchmarks/ft_recovery.py --overhead --groups 2 --stages 2 --model gpt   # ... on the example GPT, P2xD2
    python benchmarks/ft_recovery.py --model finetune --kills 2     # kills and joins with a transformers Llama

``--freeze``: the one kill is a SIGSTOP (a node that vanished without closing its sockets): the others give it up
when their all-reduce times out (``--ft-timeout``, ``TorchFT(timeout=...)``, 30 s by default; here 5 s) and the
lighthouse has dropped it (1 s without heartbeats). The frozen pipeline is killed at the end.

``--overhead``: no kills (``--overlap``: gradient buckets sent during the backward); the same steps with fault tolerance (G pipelines, one torchrun each) and without it (one
P x D job of the same processes, gradients averaged by DDP), in ``--pairs`` pairs (4; who goes first alternates);
prints both median step times and the ratio pair by pair.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
WORKER = "tests/workers/ft_train.py"


def _median_step(out: Path, name: str) -> float:
    ended = [t for _, t in torch.load(out / name)["ended"]][5:]  # past the first steps (schedules built)
    return statistics.median(b - a for a, b in zip(ended, ended[1:]))


def overhead(args: argparse.Namespace) -> None:
    steps = 60
    worker = [WORKER, "--stages", str(args.stages), "--steps", str(steps), "--width", str(args.width),
              "--model", args.model]  # fmt: skip
    overlap = ["--overlap"] if args.overlap else []
    base = [sys.executable, "-m", "lightning_spot.cli", "run", "--lighthouse-port", "0"]
    ft = [*base, "--replica-groups", str(args.groups), "--nproc-per-node", str(args.stages)]
    plain = [*base, "--nproc-per-node", str(args.groups * args.stages)]
    times: dict[str, list[float]] = {"torchft": [], "plain": []}
    for pair in range(args.pairs):
        order = (("torchft", ft), ("plain", plain))
        for kind, cmd in order if pair % 2 == 0 else reversed(order):  # (who goes first alternates too)
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "out"
                extra = ["--plain"] if kind == "plain" else overlap
                run = [*cmd, worker[0], str(out), *worker[1:], *extra]
                code = subprocess.call(run, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                       env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
                if code != 0:
                    raise SystemExit(f"{kind} run failed ({code}): {' '.join(run)}")
                name = "group0_rank0.pt" if kind == "torchft" else "group?_rank0.pt"
                times[kind].append(_median_step(out, name))
                if kind == "torchft":
                    spent = torch.load(out / name)["ft_seconds"]
                    print(
                        "  torchft per step: " + ", ".join(f"{k} {v / steps * 1000:.1f} ms" for k, v in spent.items())
                    )
    ft_s, plain_s = statistics.median(times["torchft"]), statistics.median(times["plain"])
    ratios = [a / b for a, b in zip(times["torchft"], times["plain"])]
    print(f"{args.groups} pipelines x {args.stages} stage(s), {steps} steps: median step with torchft "
          f"{ft_s * 1000:.1f} ms, without {plain_s * 1000:.1f} ms: {ft_s / plain_s:.3f}x; pair by pair "
          f"{[round(r, 3) for r in ratios]}, median {statistics.median(ratios):.3f}x "
          f"(runs: {[round(t * 1000, 1) for t in times['torchft']]} vs {[round(t * 1000, 1) for t in times['plain']]} ms)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--every", type=int, default=25, help="steps between kills (time for the joiner to return)")
    parser.add_argument("--step-sleep", type=float, default=0.2)
    parser.add_argument("--overhead", action="store_true", help="per-step cost of the quorum instead of kills")
    parser.add_argument("--freeze", action="store_true", help="one SIGSTOP instead of kills")
    parser.add_argument("--ft-timeout", type=float, default=5.0, help="--freeze: TorchFT(timeout=...)")
    parser.add_argument("--width", type=int, default=32, help="the model's width (longer steps, more state)")
    parser.add_argument("--overlap", action="store_true", help="--overhead: TorchFT(overlap=True)")
    parser.add_argument("--pairs", type=int, default=4, help="--overhead: runs with and without torchft, in turn")
    parser.add_argument(
        "--model",
        choices=("tiny", "gpt", "finetune"),
        default="tiny",
        help="the test model, the example GPT, or a transformers Llama fine-tuned on padded batches",
    )
    args = parser.parse_args()
    if args.overhead:
        overhead(args)
        return
    if args.freeze:
        args.kills = 1
    steps = args.every * (args.kills + 1)
    dying = list(range(1, args.groups))
    kills = [f"{dying[i % len(dying)]}:{args.stages - 1}:{args.every * (i + 1)}" for i in range(args.kills)]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        cmd = [
            sys.executable, "-m", "lightning_spot.cli", "run", "--replica-groups", str(args.groups),
            "--nproc-per-node", str(args.stages), "--lighthouse-port", "0", "--max-restarts", str(args.kills),
            WORKER, str(out), "--stages", str(args.stages), "--steps", str(steps),
            "--step-sleep", str(args.step_sleep), "--die", ",".join(kills), "--groups", str(args.groups),
            "--width", str(args.width), "--model", args.model,
        ]  # fmt: skip
        if args.freeze:
            cmd += ["--freeze", "--ft-timeout", str(args.ft_timeout)]
        started = time.monotonic()
        log = Path(tmp) / "run.log"
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
            try:
                while proc.poll() is None and not (args.freeze and (out / "group0_rank0.pt").exists()):
                    time.sleep(0.5)
                time.sleep(1.0)  # (the survivors' files are complete)
            finally:
                if proc.poll() is None:  # a frozen pipeline never ends: its torchrun cannot tell
                    os.killpg(proc.pid, signal.SIGKILL)
                code = proc.wait() if not args.freeze else 0
        if os.environ.get("FT_KEEP_LOG"):
            import shutil

            shutil.copy(log, os.environ["FT_KEEP_LOG"])
        if code != 0:
            print(log.read_text()[-6000:])
            raise SystemExit(f"the run failed with exit code {code}")
        print(f"{args.groups} pipelines of {args.stages} stage(s), {steps} steps, {args.kills} kills: "
              f"{time.monotonic() - started:.0f} s")  # fmt: skip
        survivor = torch.load(out / "group0_rank0.pt")
        ends = [t for _, t in survivor["ended"]]
        gaps = [b - a for a, b in zip(ends, ends[1:])]
        usual = statistics.median(gaps)
        print(f"pipeline 0: median step {usual * 1000:.0f} ms (incl. {args.step_sleep * 1000:.0f} ms sleep)")
        span = ends[-1] - ends[0]
        print(f"pipeline 0: useful-time share {len(gaps) * usual / span:.1%} from its first to its last step "
              f"({len(gaps)} steps at the median step time / {span:.1f} s; a kill every {args.every} steps, "
              f"~{args.every * usual:.0f} s)")  # fmt: skip
        if os.environ.get("FT_KEEP_LOG"):
            for (step, a), g in zip(survivor["ended"], gaps):
                if g > 2 * usual:
                    print(f"    long gap after step {step} at {a:.3f}: {g:.2f} s")
        recoveries, kill_times = [], []
        for marker in sorted(out.glob("died_group*"), key=lambda p: float(p.read_text())):
            killed = float(marker.read_text())
            kill_times.append(killed)
            after = next(t for t in ends if t > killed)
            recoveries.append(after - killed)
            print(f"  {marker.name}: next committed step of pipeline 0 after {after - killed:.2f} s")
        heals_file = out / "heals.jsonl"
        heals = [json.loads(line) for line in heals_file.read_text().splitlines()] if heals_file.exists() else []
        stalls = []
        for heal in heals:
            # the survivor's steps that were under way while the joiner restored and ran its first step
            around = [(a, g) for a, g in zip(ends, gaps) if a - usual <= heal["time"] <= a + g + usual]
            longest = max(around, key=lambda ag: ag[1], default=(0.0, usual))
            stall = longest[1] - usual
            # a join in the step a kill was detected in: that step's wait is the kill's (counted above), not the join's
            with_kill = any(longest[0] <= k <= longest[0] + longest[1] for k in kill_times)
            if not with_kill:
                stalls.append(stall)
            rate = heal["bytes"] / max(heal["restore_seconds"], 1e-9) / 2**20
            join = heal.get("join_seconds", 0.0)
            moved = heal["bytes"] / max(join, 1e-9) / 2**20
            print(f"  join of pipeline {heal['group']} rank {heal['rank']} at step {heal['step']}: restore "
                  f"{heal['restore_seconds'] * 1000:.0f} ms ({heal['bytes'] / 1024:.0f} KiB, {rate:.0f} MiB/s); joining "
                  f"quorum with the transfer {join:.2f} s (>= {moved:.0f} MiB/s); "
                  f"pipeline 0 stalled {stall:.2f} s beyond its usual step"
                  f"{' (with a kill in that step: not counted as a join stall)' if with_kill else ''}")  # fmt: skip
        what = f"SIGSTOP (all-reduce timeout {args.ft_timeout:.0f} s)" if args.freeze else "kill"
        print(f"{what} -> survivors' next committed step: median {statistics.median(recoveries):.2f} s "
              f"(max {max(recoveries):.2f} s, {len(recoveries)} events)")  # fmt: skip
        if stalls:
            print(f"join stall: median {statistics.median(stalls):.2f} s, max {max(stalls):.2f} s (goal <= 0.5 s)")


if __name__ == "__main__":
    main()
