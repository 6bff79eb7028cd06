"""What ``generate`` costs on a model split into stages (``runtime/outside_calls.py``) against the same model in one
process: milliseconds per new token, greedy, key-value cache on.

A tiny Hugging Face Llama (``--layers`` blocks of ``--hidden``), trained one step so that a Trainer has placed it,
then ``model.generate`` of ``--tokens`` tokens for a batch of 4 prompts, timed on every rank (the median of
``--repeats`` calls). The one-process figure is the same model and call without a Trainer. Each side keeps the
threads it gets by default (the pipeline's ranks one each on a 2-core machine, the single process both cores). Each
token of the pipelined call runs the stages one after the other (nothing overlaps), plus per call: the ranks' meeting in the
store, one hidden state per stage boundary, the head's logits broadcast, the random state shared twice.

    python benchmarks/generate_outside_steps.py                    # P2xD1 on 2 processes
    python benchmarks/generate_outside_steps.py --hidden 512 --layers 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # for benchmarks.new_shapes

from benchmarks.new_shapes import alternating_medians  # noqa: E402


def _model(hidden: int, layers: int) -> object:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=1000,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def _time_generate(model: object, tokens: int, repeats: int) -> float:
    import torch

    prompt = torch.randint(0, 1000, (4, 16), generator=torch.Generator().manual_seed(1))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)  # type: ignore[attr-defined]
        times.append(time.perf_counter() - start)
    return statistics.median(times) / tokens * 1000


def _worker(kind: str, hidden: int, layers: int, tokens: int, repeats: int) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_spot import SpotPipelineStrategy

    if kind == "one":
        print(f"RESULT {_time_generate(_model(hidden, layers), tokens, repeats):.3f}")
        return

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _model(hidden, layers)

        def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss  # type: ignore[operator,no-any-return]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    module = LM()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SpotPipelineStrategy(pipeline_stages=2, microbatches=2),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(TensorDataset(torch.randint(0, 1000, (8, 16))), batch_size=8))
    per_token = _time_generate(module.model, tokens, repeats)
    if trainer.global_rank == 0:
        print(f"RESULT {per_token:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", choices=["one", "P2xD1"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = ["--hidden", str(args.hidden), "--layers", str(args.layers), "--tokens", str(args.tokens)]
    if args.worker:
        _worker(args.worker, args.hidden, args.layers, args.tokens, args.repeats)
        return
    shape += ["--repeats", str(args.repeats)]
    commands = {kind: [sys.executable, __file__, "--worker", kind, *shape] for kind in ("one", "P2xD1")}
    medians = alternating_medians(commands, args.rounds)
    one, pipelined = medians["one"], medians["P2xD1"]
    print(
        f"Llama {args.layers} x {args.hidden}, batch 4, {args.tokens} new tokens: one process {one:.2f} ms/token, "
        f"P2xD1 {pipelined:.2f} ms/token ({pipelined / one:.2f}x)"
    )


if __name__ == "__main__":
    main()
