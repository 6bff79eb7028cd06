"""Fine-tune a Hugging Face Llama pipelined on the bundled text (byte tokens), unchanged model code.

    python examples/hf_llama/train.py                                   # 4 CPU processes: P2 x D2, random init
    python examples/hf_llama/train.py --pipeline-stages 4 --max-steps 200
    lightning-spot fit --config examples/hf_llama/config.yaml            # the same through LightningCLI

For a real checkpoint, change two lines (and use its tokenizer for the data):

    model = LlamaLM(pretrained="checkpoints/llama-3.2-1b")              # its config, built on the meta device
    strategy = SpotPipelineStrategy(pretrained="checkpoints/llama-3.2-1b")   # each rank reads its stages

(``huggingface-cli download meta-llama/Llama-3.2-1B --local-dir checkpoints/llama-3.2-1b`` fetches one.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere in the repo

from examples.gpt.data import ByteTextDataModule
from examples.hf_llama.model import LlamaLM
from lightning_spot import PipelineThroughput, SpotCheckpoint, SpotPipelineStrategy


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--accelerator", default="cpu", help="cpu (gloo) or gpu (NCCL)")
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--precision", default=None, help="e.g. bf16-mixed on a GPU (default: Lightning's, 32-true)")
    p.add_argument("--pipeline-stages", default="2", help="P, or 'auto'")
    p.add_argument("--microbatches", default="4")
    p.add_argument("--schedule", default="1F1B")
    p.add_argument("--batch-size", type=int, default=32, help="global batch (any layout)")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--hidden-size", type=int, default=128, help="random-init config: width")
    p.add_argument("--layers", type=int, default=4, help="random-init config: decoder layers")
    p.add_argument("--heads", type=int, default=4, help="random-init config: attention heads")
    p.add_argument("--max-steps", type=int, default=120)
    p.add_argument("--val-every", type=int, default=40)
    p.add_argument("--pretrained", default=None, help="a save_pretrained directory to start from")
    p.add_argument("--root", default="runs/hf_llama")
    p.add_argument("--checkpoint-every", type=int, default=40, help="steps between durable checkpoints")
    p.add_argument("--no-resume", action="store_true")
    return p.parse_args(argv)


def _int_or_auto(value: str) -> int | str:
    return value if value == "auto" else int(value)


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    L.seed_everything(42, verbose=False)
    model = LlamaLM(
        pretrained=args.pretrained,
        hidden_size=args.hidden_size,
        layers=args.layers,
        heads=args.heads,
        max_steps=args.max_steps,
    )
    data = ByteTextDataModule(block_size=args.block_size, batch_size=args.batch_size)
    strategy = SpotPipelineStrategy(
        pipeline_stages=_int_or_auto(args.pipeline_stages),
        microbatches=_int_or_auto(args.microbatches),
        schedule=args.schedule,
        pretrained=args.pretrained,
    )
    throughput = PipelineThroughput(tokens_per_sample=args.block_size)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        precision=args.precision,
        strategy=strategy,
        max_steps=args.max_steps,
        val_check_interval=args.val_every,
        check_val_every_n_epoch=None,
        log_every_n_steps=10,
        default_root_dir=args.root,
        callbacks=[throughput, SpotCheckpoint(every_n_train_steps=args.checkpoint_every, resume=not args.no_resume)],
        enable_checkpointing=False,
    )
    trainer.fit(model, data)
    summary = {**throughput.summary(), **{k: float(v) for k, v in trainer.callback_metrics.items()}}
    if trainer.is_global_zero:
        print(
            f"done: layout {strategy.layout}, train_loss {summary.get('train_loss', float('nan')):.3f}, "
            f"val_loss {summary.get('val_loss', float('nan')):.3f}, {summary.get('samples_per_sec', 0):.1f} samples/s, "
            f"{summary.get('step_seconds', float('nan')) * 1000:.1f} ms/step"
        )
    return summary


if __name__ == "__main__":
    main()
