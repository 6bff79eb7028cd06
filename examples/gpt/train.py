"""Train the small GPT on the bundled text with spot_pipeline.

    python examples/gpt/train.py                      # 4 CPU processes: 2 pipeline stages x 2 replicas
    python examples/gpt/train.py --pipeline-stages 4 --max-steps 200   # resumes on another layout
    python examples/gpt/train.py --accelerator gpu --devices 8 --pipeline-stages 4 --n-layer 12
    python examples/gpt/train.py --offload parameters --schedule LoopedBFS --n-layer 8   # weights in host memory
    python examples/gpt/train.py --stream s3://bucket/corpus   # the text as token shards, read as a stream
    python examples/gpt/train.py --litdata                     # the windows as LitData chunks, each replica its shard

Checkpoints go to ROOT/spot_checkpoints (or --checkpoint-dir, e.g. s3://bucket/run); running the
script again resumes from the latest one.

Lightning launches the worker processes itself; under torchrun it uses the ones torchrun started.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere in the repo

from examples.gpt.data import ByteTextDataModule
from examples.gpt.model import TinyGPT
from examples.gpt.progress import progress_bar
from lightning_spot import PipelineThroughput, PipelineTimeline, SpotCheckpoint, SpotPipelineStrategy
from lightning_spot.layout import layout_label


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--pipeline-stages", default="2", help="P, or 'auto'")
    p.add_argument("--microbatches", default="4", help="micro-batches per replica and step, or 'auto'")
    p.add_argument("--schedule", default="1F1B")
    p.add_argument("--batch-size", type=int, default=32, help="global batch (any layout)")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--max-steps", type=int, default=120)
    p.add_argument("--val-every", type=int, default=40)
    p.add_argument("--precision", default="32-true")
    p.add_argument(
        "--offload",
        default=None,
        help="training state in host memory: optimizer, activations, parameters, several joined by '+', or auto",
    )
    p.add_argument("--root", default="runs/gpt", help="logs and checkpoints")
    p.add_argument("--checkpoint-dir", default=None, help="any fsspec URL; default: ROOT/spot_checkpoints")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        help="steps between durable checkpoints (default: chosen from their measured cost and the run's interruptions)",
    )
    p.add_argument("--no-resume", action="store_true", help="start from scratch even if checkpoints exist")
    p.add_argument(
        "--stream",
        nargs="?",
        const="",
        default=None,
        help="read the training text as a stream of token shards written to this URL (default ROOT/token_shards)",
    )
    p.add_argument(
        "--litdata",
        nargs="?",
        const="",
        default=None,
        help="write the training windows with LitData's optimize to this directory (default ROOT/litdata) and read "
        "them back with its StreamingDataset, each replica its own shard (pip install --no-deps litdata==0.2.76)",
    )
    p.add_argument("--seed", type=int, default=42)
    p.add_argument(
        "--fault-tolerance",
        choices=("none", "torchft"),
        default="none",
        help="torchft: each pipeline a replica group, survivors train on (one lightning-spot run per pipeline, "
        "REPLICA_GROUP_ID set; see examples/deploy)",
    )
    p.add_argument(
        "--plain",
        action="store_true",
        help="train with Lightning's own strategy for the devices instead (no pipeline, no SpotCheckpoint): a baseline",
    )
    p.add_argument(
        "--timeline-steps",
        type=int,
        default=2,
        help="trace this many steps from step 10 into ROOT/pipeline_timeline (trace.json, timeline.png); 0: off",
    )
    return p.parse_args(argv)


def _int_or_auto(value: str) -> int | str:
    return value if value == "auto" else int(value)


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    L.seed_everything(args.seed, verbose=False)
    model = TinyGPT(
        block_size=args.block_size,
        d_model=args.d_model,
        n_layer=args.n_layer,
        n_head=args.n_head,
        max_steps=args.max_steps,
    )
    stream = (args.stream or str(Path(args.root) / "token_shards")) if args.stream is not None else None
    shards = (args.litdata or str(Path(args.root) / "litdata")) if args.litdata is not None else None
    data = ByteTextDataModule(block_size=args.block_size, batch_size=args.batch_size, stream=stream, litdata=shards)
    throughput = PipelineThroughput(tokens_per_sample=args.block_size)
    checkpoints = SpotCheckpoint(
        dirpath=args.checkpoint_dir, every_n_train_steps=args.checkpoint_every, resume=not args.no_resume
    )
    timeline = [PipelineTimeline(start_step=10, num_steps=args.timeline_steps)] if args.timeline_steps else []
    strategy = SpotPipelineStrategy(
        pipeline_stages=_int_or_auto(args.pipeline_stages),
        microbatches=_int_or_auto(args.microbatches),
        schedule=args.schedule,
        offload=args.offload.split("+") if args.offload and args.offload != "auto" else args.offload,
        fault_tolerance="torchft" if args.fault_tolerance == "torchft" else None,
    )
    callbacks: list[L.Callback] = [throughput] if args.plain else [throughput, checkpoints, *timeline]
    callbacks += progress_bar()  # ("Epoch 3/7" where Lightning's bar reads "Epoch 3/-2" with max_steps alone)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy="auto" if args.plain else strategy,
        precision=args.precision,
        max_steps=args.max_steps,
        val_check_interval=args.val_every,
        check_val_every_n_epoch=None,
        log_every_n_steps=10,
        default_root_dir=args.root,
        callbacks=callbacks,
        enable_checkpointing=False,  # SpotCheckpoint does it
    )
    trainer.fit(model, data)
    summary = {**throughput.summary(), **{k: float(v) for k, v in trainer.callback_metrics.items()}}
    if trainer.is_global_zero:
        if not args.plain and strategy.restored_manifest is not None:
            print(
                f"resumed from step {strategy.restored_manifest['step']} "
                f"(written on {layout_label(strategy.restored_manifest['layout'])})"
            )
        restored = strategy.restored_manifest if not args.plain else None
        if restored is not None and restored["step"] >= args.max_steps:
            print(
                f"nothing to train: the checkpoint in {checkpoints.url} is at step {restored['step']} of "
                f"--max-steps {args.max_steps}; raise --max-steps to train on, or pass --no-resume to start again"
            )
            return summary
        print(
            f"done: layout {'plain' if args.plain else strategy.layout}, train_loss {summary.get('train_loss', float('nan')):.3f}, "
            f"val_loss {summary.get('val_loss', float('nan')):.3f}, val_ppl {summary.get('val_ppl', float('nan')):.2f}, "
            f"{summary.get('samples_per_sec', 0):.1f} samples/s, {summary.get('tokens_per_sec', 0):.0f} tokens/s"
        )
    return summary


if __name__ == "__main__":
    main()
