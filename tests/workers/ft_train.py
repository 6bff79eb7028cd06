"""Worker: one pipeline (replica group) of a torchft job; saves its final parameters.

python tests/workers/ft_train.py OUT_DIR [--die-at STEP] [--die GROUP:RANK:STEP] [--stages P] [--steps N] [--step-sleep S]

Environment: TORCHFT_LIGHTHOUSE, REPLICA_GROUP_ID and the process-group variables of this pipeline alone.
``--die-at STEP``: this pipeline's rank 0 kills itself (SIGKILL) after the forward of step STEP, before its gradients
reach the others (the survivors' all-reduce of that step fails and the step is run again without it).
``--die GROUP:RANK:STEP[,...]``: that rank of that pipeline kills itself the same way (at the first step >= STEP at
which ``--groups`` pipelines are in the quorum), once each (a marker in
OUT_DIR keeps its restart alive). A process that took a peer's state adds a line to ``OUT_DIR/heals.jsonl``; every process, what it resumed from
to ``OUT_DIR/starts.jsonl``. Every process writes ``OUT_DIR/started/group{G}_rank{R}_{pid}`` when it starts.
``--end-after-heal GROUP:K``: train until K steps after a replacement of pipeline GROUP (started after one of its
processes was killed) took a peer's state (at most ``--steps``), so that it joins mid-run however slowly it starts;
every pipeline ends at that step. GROUP ``*``: after any pipeline's first such heal.
``--stages 0``: one stage per process of the pipeline (its depth follows the nodes its torchrun got).
``--stop-file PATH``: every step's end checks for PATH; training stops once it exists.
``--freeze``: ``--die`` stops the process with SIGSTOP (a node that vanished without closing its sockets).
``--ft-timeout S``: ``TorchFT(timeout=S)``, how long the others' all-reduce waits for a silent peer.
``--plain``: the same training without fault tolerance (one P x D job of all processes; for overhead figures).
``--overlap``: ``TorchFT(overlap=True)`` (gradient buckets sent during the backward); ``--bucket-bytes N``: buckets
of N bytes (the same on every pipeline: several on a tiny model).
``--min-replicas N``: ``TorchFT(min_replicas=N)`` (pipelines that must start together).
``--accumulate K``: ``Trainer(accumulate_grad_batches=K)``. ``--schedule NAME``: ``SpotPipelineStrategy(schedule=NAME)``
(a looped one runs two stages per process). ``--tied``: ``--model finetune`` with its embedding tied to its output layer.
``--offload LEVEL``: ``SpotPipelineStrategy(offload=LEVEL)`` (``optimizer``: masters and Adam's state in host memory).
``--timeline DIR``: PipelineTimeline of every step into DIR (``trace.json``).
``--checkpoint DIR``: SpotCheckpoint(dirpath=DIR, every_n_train_steps=5, save_on_train_end=False).
``--step-sleep S``: sleep S seconds after every step (time for a replacement to start and join).
``--sgd``: the tiny model with SGD (lr 0.05, momentum 0.9) and no schedule (long runs whose batch shares change stay
within float32's noise of one process; Adam does not, see FIELD-NOTES). ``--step-log``: every process appends
``step time`` to ``OUT_DIR/steps/group{G}_rank{R}_{pid}`` at each step's end (a run's step history, read live).
``--model finetune``: a transformers Llama fine-tuned on padded batches whose labels are -100 on prompts and padding
(a loss averaged over a varying number of tokens), ``FINETUNE_SAMPLES`` samples so that each epoch ends with a
short batch, StepLR per epoch; see :func:`finetune_scenario`. ``--model gpt``: the example GPT (``examples/gpt``, its
config's sizes: 4 layers of width 128, batches of 32 x 64 bytes, 4 micro-batches) on random bytes.
Writes ``OUT_DIR/group{G}_rank{R}.pt`` (parameters, global step, pid, steps discarded, quorum changes, the step it
took a peer's state at, the wall-clock time each step ended, the logged values at the end and at each epoch's end).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_spot import PipelineTimeline, SpotCheckpoint, SpotPipelineStrategy
from lightning_spot.torchft import TorchFT
from tests.models import HIDDEN, make_loader, make_model

BATCH, SAMPLES, STEPS = 12, 96, 10
#: 8 global batches of 12 and a last one of 8 per epoch (4 micro-batch pairs: shares of 2, 1, 1 among 3 pipelines)
FINETUNE_SAMPLES = 104
GROUP = os.environ.get("REPLICA_GROUP_ID", "?")


def finetune_scenario(steps: int, accumulate: int = 1, family: str = "llama", tied: bool = False) -> dict[str, Any]:
    """``--model finetune`` as a scenario of ``tests.parity.reference_run`` (``--accumulate``: its batches per step;
    ``--tied``: the input embedding shared with the output layer)."""
    return {
        "model": {
            "cls": "FineTune",
            "family": family,
            "tied": tied,
            "kind": "causal",
            "lr": 1e-3,
            "scheduler": True,
            "epoch_mean": True,
        },
        "loader": {"batch_size": BATCH, "n": FINETUNE_SAMPLES, "padded": "sft"},
        "trainer": {"max_steps": steps, "accumulate_grad_batches": accumulate},
    }


def tiny_model_kwargs(sgd: bool = False) -> dict[str, Any]:
    """The tiny model's settings: Adam with StepLR per epoch (schedules must follow commits), or ``sgd``."""
    return {"seed": 7, "optimizer": "sgd", "lr": 0.05} if sgd else {"seed": 7, "scheduler": True}


class Report(L.Callback):
    def __init__(
        self,
        out: Path,
        die: list[tuple[str, int, int]],
        sleep: float,
        end: str | None,
        full: int,
        freeze: bool,
        stop_file: Path | None = None,
        step_log: bool = False,
    ) -> None:
        self.out, self.die, self.sleep, self.full, self.freeze = out, die, sleep, full, freeze
        self.step_log = None
        if step_log:
            (out / "steps").mkdir(parents=True, exist_ok=True)
            self.step_log = open(out / "steps" / f"group{GROUP}_rank{os.environ['RANK']}_{os.getpid()}", "a")
        self.stop_file = stop_file
        self.end = tuple(end.split(":")) if end else None
        self.ended: list[tuple[int, float]] = []
        #: the logged values at each epoch's end (epoch means)
        self.epochs: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.ended.append((trainer.global_step, time.time()))
        if self.step_log is not None:
            self.step_log.write(f"{trainer.global_step} {self.ended[-1][1]:.3f}\n")
            self.step_log.flush()
        time.sleep(self.sleep)
        # (agreed over the pipeline's ranks: one that saw the file a step before its peer would leave it inside a
        # collective, and the peer's agent would start it again alone)
        if self.stop_file is not None and trainer.strategy.reduce_boolean_decision(self.stop_file.exists(), all=False):
            trainer.should_stop = True
        if self.end is not None:
            group, more = self.end[0], int(self.end[1])
            deaths = [float(p.read_text()) for p in self.out.glob(f"died_group{group}_*")]
            record = self.out / "heals.jsonl"
            lines = record.read_text().splitlines() if record.exists() and deaths else []
            heals = [h for h in map(json.loads, lines) if group in ("*", h["group"]) and h["time"] > min(deaths)]
            steps = [h["step"] for h in heals]
            if steps and trainer.global_step >= steps[0] + more:
                trainer.should_stop = True

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Any) -> None:
        replicas = trainer.strategy.replicas  # type: ignore[attr-defined]
        for group, rank, step in (
            self.die if replicas is not None else ()
        ):  # the first step >= STEP at which every pipeline is in the quorum
            if (group, rank) != (GROUP, trainer.global_rank) or trainer.global_step < step:
                continue
            if replicas.participants < self.full:
                return
            marker = self.out / f"died_group{GROUP}_step{step}"
            if not marker.exists():
                marker.write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP if self.freeze else signal.SIGKILL)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.epochs.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        healed = trainer.strategy.restored_manifest or {}  # type: ignore[attr-defined]
        start = {"group": GROUP, "rank": trainer.global_rank, "pid": os.getpid(), "step": trainer.global_step}
        with open(self.out / "starts.jsonl", "a") as f:  # (what each process resumed from)
            f.write(json.dumps({**start, "tier": healed.get("tier")}) + "\n")
        if healed.get("tier") == "peer":
            line = {"group": GROUP, "rank": trainer.global_rank, "time": time.time(), **healed}
            with open(self.out / "heals.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        replicas = trainer.strategy.replicas  # type: ignore[attr-defined]  (None with --plain)
        healed = trainer.strategy.restored_manifest or {}  # type: ignore[attr-defined]
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "state_dict": pl_module.state_dict(),
                "global_step": trainer.global_step,
                "pid": os.getpid(),
                "discarded": replicas.discarded if replicas else 0,
                "quorum_changes": replicas.quorum_changes if replicas else 0,
                "ended": self.ended,
                "ft_seconds": dict(replicas.seconds) if replicas else {},
                "launched_early": replicas.buckets.launched_early if replicas and replicas.buckets else 0,
                "healed_at": healed.get("step") if healed.get("tier") == "peer" else None,
                # the speeds the batch shares followed last (each pipeline's, agreed), its place and its rows
                "shares": replicas.shares if replicas else None,
                "participant_rank": replicas.participant_rank if replicas else 0,
                "rows": replicas.rows if replicas else 0,
                "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
                "epoch_metrics": self.epochs,
            },
            self.out / f"group{GROUP}_rank{trainer.global_rank}.pt",
        )


def main() -> None:
    if os.environ.get("FT_DUMP"):  # every thread's stack after that many seconds (a hang's place)
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["FT_DUMP"]), exit=False)
    if os.environ.get("FT_DEBUG"):
        import logging

        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
        logging.getLogger("torchft.manager").setLevel(logging.INFO)
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--die-at", type=int, default=None)
    parser.add_argument("--die", default=None)
    parser.add_argument("--stages", type=int, default=1, help="pipeline stages (0: one per process of the pipeline)")
    parser.add_argument("--stop-file", type=Path, default=None, help="stop training once this file exists")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--checkpoint", "--checkpoint-dir", default=None)  # (the deploy recipes pass the latter)
    parser.add_argument("--end-after-heal", default=None)
    parser.add_argument("--width", type=int, default=HIDDEN, help="the model's width (larger: longer steps)")
    parser.add_argument("--freeze", action="store_true", help="--die stops the process (SIGSTOP) instead")
    parser.add_argument("--ft-timeout", type=float, default=30.0, help="TorchFT(timeout=...)")
    parser.add_argument("--quorum-timeout", type=float, default=60.0, help="TorchFT(quorum_timeout=...)")
    parser.add_argument("--plain", action="store_true", help="no fault tolerance: all processes are one P x D job")
    parser.add_argument("--groups", type=int, default=1, help="kill only when this many pipelines are in the quorum")
    parser.add_argument("--model", choices=("tiny", "finetune", "gpt"), default="tiny")
    parser.add_argument("--timeline", default=None, help="trace every step into this directory")
    parser.add_argument("--overlap", action="store_true", help="TorchFT(overlap=True)")
    parser.add_argument("--bucket-bytes", type=int, default=None, help="gradient buckets this small (every pipeline)")
    parser.add_argument("--offload", default=None, help="SpotPipelineStrategy(offload=...), e.g. optimizer")
    parser.add_argument("--accumulate", type=int, default=1, help="Trainer(accumulate_grad_batches=...)")
    parser.add_argument("--family", default="llama", help="--model finetune: the transformers family (llama, gpt2)")
    parser.add_argument("--tied", action="store_true", help="--model finetune: tie the embedding and the output layer")
    parser.add_argument("--schedule", default="auto", help="SpotPipelineStrategy(schedule=...), e.g. Interleaved1F1B")
    parser.add_argument("--snapshot-every", type=int, default=None, help="SpotCheckpoint(snapshot_every_n_train_steps)")
    parser.add_argument("--device-memory", type=float, default=None, help="SpotPipelineStrategy(device_memory=...)")
    parser.add_argument("--min-replicas", type=int, default=1, help="TorchFT(min_replicas=...): the first quorum waits")
    parser.add_argument("--sgd", action="store_true", help="the tiny model with SGD and no learning-rate schedule")
    parser.add_argument("--step-log", action="store_true", help="each step's end appended to OUT/steps/...")
    args = parser.parse_args()
    if args.bucket_bytes:  # (several buckets on a tiny model, so that some can go out during the backward)
        from lightning_spot.torchft import early_buckets

        early_buckets.BUCKET_BYTES = args.bucket_bytes
    started = args.out / "started"
    started.mkdir(parents=True, exist_ok=True)
    (started / f"group{GROUP}_rank{os.environ['RANK']}_{os.getpid()}").touch()
    die = [(GROUP, 0, args.die_at)] if args.die_at is not None else []
    for spec in args.die.split(",") if args.die else []:
        group, rank, step = spec.split(":")
        die.append((group, int(rank), int(step)))
    if args.model == "finetune":
        scenario = finetune_scenario(args.steps, args.accumulate, args.family, args.tied)
        model, loader = make_model(**scenario["model"]), make_loader(**scenario["loader"])
    elif args.model == "gpt":  # the example GPT as its config trains it (batch 32, 64 bytes), on random bytes
        from examples.gpt.data import ByteWindows
        from examples.gpt.model import TinyGPT

        torch.manual_seed(7)
        model = TinyGPT(n_layer=4, max_steps=args.steps)
        data = torch.randint(0, 256, (32 * 64 * (args.steps + 1),), generator=torch.Generator().manual_seed(0))
        loader = torch.utils.data.DataLoader(ByteWindows(data, block_size=64, stride=64), batch_size=32)
    else:  # StepLR per epoch: schedules must follow commits
        model = make_model(**tiny_model_kwargs(args.sgd), width=args.width)
        loader = make_loader(batch_size=BATCH, n=SAMPLES)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=SpotPipelineStrategy(
            pipeline_stages=args.stages or int(os.environ["WORLD_SIZE"]),
            microbatches=4 if args.model == "gpt" else 2,
            schedule=args.schedule,
            offload=args.offload,
            device_memory=args.device_memory,
            fault_tolerance=None
            if args.plain
            else TorchFT(
                timeout=args.ft_timeout,
                quorum_timeout=args.quorum_timeout,
                overlap=args.overlap,
                min_replicas=args.min_replicas,
            ),
        ),
        max_steps=args.steps,
        accumulate_grad_batches=args.accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[
            Report(
                args.out,
                die,
                args.step_sleep,
                args.end_after_heal,
                args.groups,
                args.freeze,
                args.stop_file,
                args.step_log,
            ),
            *(
                [
                    SpotCheckpoint(
                        args.checkpoint,
                        every_n_train_steps=5,
                        save_on_train_end=False,
                        heartbeat_seconds=0.5,
                        snapshot_every_n_train_steps=args.snapshot_every,
                        snapshot_dir=str(args.out / "snapshots"),
                    )
                ]
                if args.checkpoint
                else []
            ),
            *([PipelineTimeline(args.timeline, start_step=0, num_steps=10**6, gantt=False)] if args.timeline else []),
        ],
    )
    trainer.fit(model, loader)


if __name__ == "__main__":
    main()
