"""The example's training windows as LitData chunks (``litdata.optimize``), read back by LitData's
``StreamingDataset``: spot_pipeline's sharded mode, where each replica reads only its own shard
(docs/streaming.md).

    write_litdata("runs/gpt/litdata", train_bytes, block_size=64, stride=32)   # once; skipped when already there
    loader = litdata_loader("runs/gpt/litdata", batch_size=32)                 # the global batch

Install: ``pip install --no-deps litdata==0.2.76`` (its torchvision requirement would replace a CPU torch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def window(chunk: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One sample: ``block_size + 1`` bytes as inputs and next-byte targets (LitData's ``optimize`` runs it)."""
    data = torch.tensor(chunk, dtype=torch.long)
    return data[:-1], data[1:]


def write_litdata(directory: str, tokens: torch.Tensor, block_size: int, stride: int) -> None:
    """Write the windows of ``tokens`` as LitData chunks under ``directory`` (a local path or a URL that LitData
    reads), unless its index is there."""
    from litdata import optimize

    if (Path(directory) / "index.json").exists():
        return
    starts = range(0, len(tokens) - block_size, stride)
    chunks = [tokens[s : s + block_size + 1].tolist() for s in starts]
    optimize(fn=window, inputs=chunks, output_dir=directory, chunk_size=256, num_workers=1, mode="overwrite")


def litdata_loader(directory: str, batch_size: int, seed: int = 0) -> Any:
    """A shuffled ``StreamingDataLoader`` over the chunks in ``directory``, in global batches of ``batch_size``."""
    from litdata import StreamingDataLoader, StreamingDataset

    return StreamingDataLoader(StreamingDataset(directory, shuffle=True, seed=seed), batch_size=batch_size)
