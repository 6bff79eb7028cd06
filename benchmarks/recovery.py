"""Time to recover from a preemption: notice -> checkpoint saved -> exited -> restarted -> resumed -> first step.

A GPT-style model with a few hundred MB of training state (weights + AdamW moments) trains under
torchrun (one agent, 2 workers, ``SpotPipelineStrategy(pipeline_stages=2)``) with ``SpotCheckpoint``.
After a few steps the script sends SIGTERM to one worker (a preemption notice on one rank). Every
rank stops at the next step, commits a checkpoint and exits with code 75; torchrun restarts the
group, which resumes from that checkpoint and finishes. The timeline comes from the run history
that ``SpotCheckpoint`` records (``<run>/events``) and from each worker's start time.

The comparison is a restart from scratch: the same job started fresh (no checkpoint), timed from
process start to its first step, plus the steps that would have to be redone.

Four ways in, each timed in phases (signal -> restarted workers start; setup: imports, process
groups, planning, finding the state; the state read; the first step): a preemption notice or a
SIGKILL of one worker, with the state read from storage (durable checkpoints every 5 steps) or from
host memory (snapshots every 5 steps as well). A SIGKILL gives no time to save: the restart resumes
from the newest complete checkpoint or snapshot.

Usage::

    python benchmarks/recovery.py                 # d_model 768 x 4 layers (~0.35 GB of state), 2 CPU workers
    python benchmarks/recovery.py --quick         # small model, for a smoke run
    python benchmarks/recovery.py --json recovery.json
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
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CONFIG_ENV = "SPOT_RECOVERY_CONFIG"


# ----------------------------------------------------------------------------------------------- worker
def worker(config: dict[str, Any]) -> None:
    """One torchrun worker: records its start time, trains with SpotCheckpoint until max_steps."""
    started = time.time()
    out = Path(config["out"])
    rank = int(os.environ["RANK"])
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    (out / "starts").mkdir(parents=True, exist_ok=True)
    (out / "starts" / f"attempt{attempt}-rank{rank}.json").write_text(json.dumps({"pid": os.getpid(), "time": started}))
    (out / "exits").mkdir(parents=True, exist_ok=True)
    import atexit

    atexit.register(
        lambda: (out / "exits" / f"attempt{attempt}-rank{rank}.json").write_text(json.dumps({"time": time.time()}))
    )

    sys.path.insert(0, str(REPO))
    import lightning as L
    import torch
    from torch.utils.data import TensorDataset

    from examples.gpt.model import TinyGPT
    from lightning_spot import PreemptionWatcher, SpotCheckpoint, SpotPipelineStrategy

    class Bare(TinyGPT):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            time.sleep(config["step_seconds"])  # --quick: slow enough to be interrupted mid-run
            return self._loss(batch)[0]

    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (config["samples"], config["block"] + 1), generator=g)
    data = torch.utils.data.DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=config["batch"])
    model = Bare(
        d_model=config["d_model"],
        n_layer=config["n_layer"],
        n_head=8,
        block_size=config["block"],
        max_steps=config["steps"],
    )
    checkpoint = SpotCheckpoint(
        dirpath=config["run"],
        every_n_train_steps=config["every"],
        keep_last=2,
        heartbeat_seconds=1.0,
        preemption=PreemptionWatcher(cloud=None),
        snapshot_every_n_train_steps=config.get("snapshot_every"),
        snapshot_dir=config.get("snapshot_dir"),
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=SpotPipelineStrategy(pipeline_stages=2, microbatches=2),
        max_steps=config["steps"],
        callbacks=[checkpoint],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data)


# ----------------------------------------------------------------------------------------------- driver
def _read_json_files(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))] if folder.is_dir() else []


def _events(run: Path) -> list[dict[str, Any]]:
    return _read_json_files(run / "events")


def _torchrun(config: dict[str, Any], log: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        CONFIG_ENV: json.dumps(config),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "PYTHONPATH": str(REPO),
    }
    env.pop("LOCAL_RANK", None)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lightning_spot_launch",  # lightning-spot run's agent: forked workers, a clean leave
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=1",
            "--monitor-interval=0.2",
            str(Path(__file__).resolve()),
        ],
        env=env,
        cwd=REPO,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _wait(proc: subprocess.Popen, condition: Any, timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError(f"gave up waiting for {what}; see {log}:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)


def _state_mb(config: dict[str, Any]) -> float:
    d, n, v, b = config["d_model"], config["n_layer"], 256, config["block"]
    params = n * (12 * d * d + 13 * d) + v * d + b * d + 2 * d + d * v
    return 3 * 4 * params / 1e6  # fp32 weights + two AdamW moments


def recover(config: dict[str, Any], tmp: Path, how: str) -> dict[str, float]:
    """One interrupted-and-resumed run (``how``: "notice" = SIGTERM to one worker, "kill" = SIGKILL);
    returns the timeline in seconds after the signal and the phases of the restart."""
    log = tmp / f"torchrun-{how}.log"
    proc = _torchrun(config, log)
    try:
        run = Path(config["run"])
        first_ckpt = run / f"step-{config['every']:09d}" / "manifest.json"
        _wait(proc, first_ckpt.exists, 900, "the first checkpoint", log)
        progress_target = config["every"] + 2  # interrupt a couple of steps after a checkpoint
        _wait(proc, lambda: any(e.get("step", 0) >= progress_target for e in _events(run)), 900, "progress", log)
        victim = json.loads((Path(config["out"]) / "starts" / "attempt0-rank1.json").read_text())["pid"]
        signalled = time.time()
        os.kill(victim, signal.SIGTERM if how == "notice" else signal.SIGKILL)
        proc.wait(timeout=1800)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun failed; see {log}:\n{log.read_text()[-3000:]}")
    events = _events(run)
    starts = [e for e in events if e["kind"] == "start"]
    first_steps = [e for e in events if e["kind"] == "first_step"]
    restarts = [s for s in _read_json_files(Path(config["out"]) / "starts") if s["time"] > signalled]
    exits = [json.loads(p.read_text())["time"] for p in (Path(config["out"]) / "exits").glob("attempt0-*.json")]
    preempted = next((e for e in events if e["kind"] == "preempted"), None)
    last_step = max(e.get("step", 0) for e in events if e["time"] < signalled and e["kind"] != "start")
    stopped = preempted["step"] if preempted else last_step
    restarted = min(r["time"] for r in restarts) - signalled
    resumed = starts[1]["time"] - signalled
    read = starts[1].get("restore_seconds") or 0.0
    first = first_steps[1]["time"] - signalled
    return {
        "stopped_at_step": stopped,
        "saved": preempted["time"] - signalled if preempted else float("nan"),
        "exited": max(exits) - signalled if exits else float("nan"),  # SIGKILLed workers run no atexit
        "restarted": restarted,
        "resumed": resumed,
        "first_resumed_step": first,
        "steps_recomputed": max(0, stopped - (starts[1].get("resumed_step") or 0)),
        "tier": starts[1].get("resumed_from") or "?",
        "phase_stop": restarted,  # signal -> the restarted workers start (stop, exit, torchrun's restart)
        "phase_setup": resumed - read - restarted,  # imports, process groups, planning, finding the state
        "phase_read": read,
        "phase_first_step": first - resumed,
    }


def from_scratch(config: dict[str, Any], tmp: Path) -> dict[str, float]:
    """Process start -> first step of a fresh job (no checkpoint to load), in the same phases."""
    log = tmp / "scratch.log"
    fresh = {**config, "run": str(tmp / "scratch-run"), "out": str(tmp / "scratch-out"), "steps": 1}
    proc = _torchrun(fresh, log)
    launched = time.time()
    proc.wait(timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun failed; see {log}:\n{log.read_text()[-3000:]}")
    events = _events(Path(fresh["run"]))
    started = min(r["time"] for r in _read_json_files(Path(fresh["out"]) / "starts"))
    start = next(e for e in events if e["kind"] == "start")["time"]
    first = next(e for e in events if e["kind"] == "first_step")["time"]
    return {
        "first_step": first - launched,
        "phase_launch": started - launched,
        "phase_setup": start - started,
        "phase_first_step": first - start,
    }


MODES = {  # name: (signal, tier)
    "notice, storage": ("notice", "storage"),
    "notice, memory": ("notice", "memory"),
    "SIGKILL, storage": ("kill", "storage"),
    "SIGKILL, memory": ("kill", "memory"),
}


def main() -> None:
    if os.environ.get("LOCAL_RANK") is not None and CONFIG_ENV in os.environ:
        worker(json.loads(os.environ[CONFIG_ENV]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="d_model 128 x 2 layers")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    base = {
        "d_model": 128 if args.quick else 768,
        "n_layer": 2 if args.quick else 4,
        "block": 64,
        "batch": 8,
        "samples": 4096,
        "every": 5,
        "steps": 12 if args.quick else 14,
        "step_seconds": 0.3 if args.quick else 0.0,
    }
    print(
        f"model: TinyGPT d_model={base['d_model']} x {base['n_layer']} layers, ~{_state_mb(base):.0f} MB of weights + "
        f"AdamW state; torchrun, 2 CPU workers, P2xD1, SpotCheckpoint every {base['every']} steps to local disk"
    )
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    scratch = []
    for _ in range(args.repeats):
        for mode, (how, tier) in MODES.items():
            with tempfile.TemporaryDirectory() as tmp_dir:
                tmp = Path(tmp_dir)
                config = {**base, "run": str(tmp / "run"), "out": str(tmp / "out")}
                if tier == "memory":
                    config.update(snapshot_every=base["every"], snapshot_dir=str(tmp / "shm"))
                runs[mode].append(recover(config, tmp, how))
                print(f"  {mode}: first resumed step {runs[mode][-1]['first_resumed_step']:.2f}s", flush=True)
        with tempfile.TemporaryDirectory() as tmp_dir:
            scratch.append(from_scratch({**base, "run": "", "out": ""}, Path(tmp_dir)))
    fresh = {k: statistics.median(s[k] for s in scratch) for k in scratch[0]}
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "tier"} for mode, rs in runs.items()}
    print("\nseconds after the signal (to one worker), medians:")
    print(f"  {'':<36}" + "".join(f"{mode:>18}" for mode in MODES))
    for key, label in [
        ("saved", "checkpoint committed (notice)"),
        ("exited", "every rank exited"),
        ("restarted", "restarted workers started"),
        ("resumed", "state restored, training restarts"),
        ("first_resumed_step", "first resumed step done"),
        ("steps_recomputed", "steps recomputed"),
    ]:
        print(f"  {label:<36}" + "".join(f"{med[mode][key]:18.2f}" for mode in MODES))
    print("  tier used                           " + "".join(f"{runs[m][0]['tier']:>18}" for m in MODES))
    print("\nphases of the restart (s):")
    print(f"  {'':<36}" + "".join(f"{mode:>18}" for mode in MODES) + f"{'fresh start':>18}")
    for key, label, fresh_key in [
        ("phase_stop", "stop + restart (signal -> start)", "phase_launch"),
        ("phase_setup", "setup (imports, groups, plan)", "phase_setup"),
        ("phase_read", "state read", None),
        ("phase_first_step", "first step", "phase_first_step"),
    ]:
        row = "".join(f"{med[mode][key]:18.2f}" for mode in MODES)
        print(f"  {label:<36}{row}{fresh[fresh_key] if fresh_key else 0.0:18.2f}")
    memory_read = med["SIGKILL, memory"]["phase_read"]
    budget = fresh["first_step"] + memory_read
    print(
        f"\nfresh start: {fresh['first_step']:.2f}s from launch to the first step. Goal: a restart costs no more "
        f"than that plus the state read at memory speed ({memory_read:.2f}s) = {budget:.2f}s; SIGKILL -> first "
        f"resumed step from memory: {med['SIGKILL, memory']['first_resumed_step']:.2f}s, from storage: "
        f"{med['SIGKILL, storage']['first_resumed_step']:.2f}s"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"config": base, "recoveries": runs, "from_scratch": scratch}, indent=1))


if __name__ == "__main__":
    main()
