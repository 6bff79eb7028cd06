"""The example's text as a stream of token shards in object storage (any fsspec URL: a local directory, s3://...),
read back as a resumable ``IterableDataset`` (spot_pipeline's global-stream mode, docs/streaming.md).

    write_shards("s3://bucket/corpus", tokens, shard_tokens=16384)       # once; skipped when already there
    stream = TokenShardStream("s3://bucket/corpus", block_size=64, stride=32)

Each pass reads the shards in an order drawn from ``seed + pass`` and each shard's windows in order; the state is
(pass, shards done in this pass, windows done in the current shard), and iterating continues from it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import fsspec
import torch
from torch.utils.data import IterableDataset


def write_shards(url: str, tokens: torch.Tensor, shard_tokens: int = 16384, **storage_options: Any) -> int:
    """Write ``tokens`` (uint8 values) as shard files and an index under ``url``, unless the index is there; each
    file appears whole (written aside, then moved), so concurrent writers of the same data do not collide.
    Returns the number of shards."""
    fs, root = fsspec.core.url_to_fs(url, **storage_options)
    root = root.rstrip("/")
    if fs.exists(f"{root}/index.json"):
        return len(json.loads(fs.cat_file(f"{root}/index.json"))["shards"])
    fs.makedirs(root, exist_ok=True)
    names = []
    for i, start in enumerate(range(0, len(tokens), shard_tokens)):
        name = f"shard-{i:05d}.bin"
        _put(fs, f"{root}/{name}", bytes(tokens[start : start + shard_tokens].to(torch.uint8).tolist()))
        names.append(name)
    _put(fs, f"{root}/index.json", json.dumps({"shards": names, "dtype": "uint8"}).encode())
    return len(names)


def _put(fs: Any, path: str, data: bytes) -> None:
    aside = f"{path}.{uuid.uuid4().hex}.tmp"
    fs.pipe_file(aside, data)
    fs.mv(aside, path)


class TokenShardStream(IterableDataset):
    """Windows of ``block_size + 1`` tokens (inputs and next-token targets) from the shards under ``url``."""

    def __init__(self, url: str, block_size: int, stride: int, seed: int = 0, **storage_options: Any) -> None:
        self.url, self.block_size, self.stride, self.seed = url, block_size, stride, seed
        self.storage_options = storage_options
        self.epoch, self.shards_done, self.windows_done = 0, 0, 0
        self._names: list[str] | None = None

    def _fs(self) -> tuple[Any, str]:
        fs, root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        return fs, root.rstrip("/")

    def _order(self) -> list[str]:
        if self._names is None:
            fs, root = self._fs()
            self._names = json.loads(fs.cat_file(f"{root}/index.json"))["shards"]
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return [self._names[i] for i in torch.randperm(len(self._names), generator=g).tolist()]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = self._order()
        if self.shards_done >= len(order):  # the last pass is over: the next one
            self.epoch, self.shards_done, self.windows_done = self.epoch + 1, 0, 0
            order = self._order()
        fs, root = self._fs()
        while self.shards_done < len(order):
            data = torch.frombuffer(bytearray(fs.cat_file(f"{root}/{order[self.shards_done]}")), dtype=torch.uint8)
            data = data.long()
            windows = max(0, (len(data) - self.block_size - 1) // self.stride + 1)
            while self.windows_done < windows:
                start = self.windows_done * self.stride
                self.windows_done += 1
                chunk = data[start : start + self.block_size + 1]
                yield chunk[:-1], chunk[1:]
            self.shards_done, self.windows_done = self.shards_done + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "shards_done": self.shards_done, "windows_done": self.windows_done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.shards_done, self.windows_done = state["epoch"], state["shards_done"], state["windows_done"]
