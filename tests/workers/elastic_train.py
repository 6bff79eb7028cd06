"""Worker for torchrun tests: train with SpotCheckpoint on whatever world torchrun gives; save the final state.

torchrun ... tests/workers/elastic_train.py CONFIG.json
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch

import tests.fakefs  # noqa: F401  registers slowfile://
from lightning_spot import PipelineTimeline, PreemptionWatcher, SpotCheckpoint, SpotPipelineStrategy
from tests.models import make_loader, make_model


class SlowSteps(L.Callback):
    """Makes each step take a while, so that a test can interrupt the run in the middle; with ``hold`` (a world size
    and a step), a smaller world waits at that step until it is stopped (a node joining restarts it), so that it
    cannot finish first however slowly the joining node starts.

    ``gpu_seconds``: the pause stands for a step's work shared by the processes that train it (this world's, times
    the pipelines in the torchft quorum), as a fixed global batch is: ``gpu_seconds / processes`` per step, so that
    a process trains at the same speed whatever the cluster's size (``benchmarks/spot_replay.py --step-gpu-seconds``).
    """

    def __init__(
        self,
        seconds: float,
        hold: Optional[dict[str, int]] = None,
        stopped: Any = lambda: False,
        gpu_seconds: float = 0.0,
    ) -> None:
        self.seconds = seconds
        self.gpu_seconds = gpu_seconds
        self.hold = hold
        self.stopped = stopped
        #: (global step, wall-clock time, processes training the step) at the end of every step
        self.ended: list[tuple[int, float, int]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        replicas = getattr(trainer.strategy, "replicas", None)  # (fault_tolerance="torchft": the quorum's pipelines)
        processes = trainer.world_size * max(1, getattr(replicas, "participants", 1) or 1)
        self.ended.append((trainer.global_step, time.time(), processes))
        time.sleep(self.seconds + self.gpu_seconds / processes)
        hold = self.hold
        while (
            hold and trainer.world_size < hold["world"] and trainer.global_step >= hold["step"] and not self.stopped()
        ):
            time.sleep(0.05)


def main() -> None:
    config = json.loads(Path(sys.argv[1]).read_text())
    out = Path(config["out"])
    rank = int(os.environ.get("RANK", 0))
    (out / "pids").mkdir(parents=True, exist_ok=True)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    (out / "pids" / f"rank{rank}-attempt{restart}.pid").write_text(str(os.getpid()))
    watch = config.get("watcher", {"cloud": None})
    if os.environ.get("SPOT_TEST_AWS_METADATA"):  # this "node" has its own metadata service (spot_replay.py)
        watch = {"cloud": "aws", "endpoints": {"aws": os.environ["SPOT_TEST_AWS_METADATA"]}, "poll_interval": 0.5}
    if "watch_rank" in config and rank != config["watch_rank"]:
        watch = {**watch, "cloud": None}  # only one rank polls: its notice must stop everyone
    watcher = PreemptionWatcher(**watch)
    checkpoint = SpotCheckpoint(
        dirpath=config["run"],
        every_n_train_steps=config.get("every", 2),
        every_n_minutes=config.get("every_minutes"),
        keep_last=config.get("keep_last", 3),
        heartbeat_seconds=0.5,
        preemption=watcher,
        # the tests of the durable tier alone say nothing of snapshots: none unless an interval is given
        snapshots=config.get("snapshots", bool(config.get("snapshot_every") or config.get("snapshot_every_seconds"))),
        snapshot_every_n_train_steps=config.get("snapshot_every"),
        snapshot_every_n_seconds=config.get("snapshot_every_seconds"),
        snapshot_dir=os.environ.get("SPOT_TEST_SNAPSHOT_DIR", config.get("snapshot_dir")),  # one per "node"
    )
    slow = SlowSteps(
        config.get("step_seconds", 0.0),
        config.get("hold"),
        lambda: watcher.notice is not None,
        gpu_seconds=config.get("step_gpu_seconds", 0.0),
    )
    callbacks: list[L.Callback] = [checkpoint, slow]
    if config.get("timeline"):  # trace every step; a preempted run leaves per-rank trace files
        callbacks.append(PipelineTimeline(dirpath=str(out / "timeline"), start_step=0, num_steps=10**6, gantt=False))
    strategy = SpotPipelineStrategy(timeout=timedelta(seconds=60), **config.get("strategy", {}))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),  # num_nodes is derived from the environment
        strategy=strategy,
        max_steps=config["max_steps"],
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(
        make_model(**config.get("model", {"scheduler": True})),
        make_loader(**config.get("loader", {"batch_size": 16, "n": 80, "shuffle": True})),
    )
    group = os.environ.get("REPLICA_GROUP_ID")  # fault_tolerance="torchft": one pipeline of several
    final = out / "final" / (f"pipeline-{group}" if group is not None else "")
    final.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "state_dict": {k: v.detach().cpu() for k, v in trainer.lightning_module.state_dict().items()},
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "layout": str(strategy.layout),
            "num_nodes": strategy.num_nodes,
            "restored_step": strategy.restored_manifest["step"] if strategy.restored_manifest else None,
            "restored_tier": strategy.restored_manifest.get("tier") if strategy.restored_manifest else None,
            "report": checkpoint.report,
            "snapshot_steps": [t["step"] for t in checkpoint.snapshotter.taken] if checkpoint.snapshotter else [],
            "ended": slow.ended,
        },
        final / f"rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
