"""Byte-level language-modelling data from the text file that ships with the example."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

CORPUS = Path(__file__).parent / "data" / "corpus.txt"


class ByteWindows(Dataset):
    """Overlapping windows of ``block_size + 1`` bytes: inputs and next-byte targets."""

    def __init__(self, data: torch.Tensor, block_size: int, stride: int) -> None:
        self.data = data
        self.block_size = block_size
        self.stride = stride

    def __len__(self) -> int:
        return max(0, (len(self.data) - self.block_size - 1) // self.stride + 1)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.stride : i * self.stride + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class ByteTextDataModule(L.LightningDataModule):
    """Splits a text file into 90% training and 10% validation bytes.

    ``batch_size`` is the *global* batch under spot_pipeline (the same on any layout).
    """

    def __init__(
        self,
        path: str = str(CORPUS),
        block_size: int = 64,
        batch_size: int = 32,
        stride: int = 32,
        shuffle: bool = True,
        stream: str | None = None,
        litdata: str | None = None,
    ) -> None:
        """``stream``: a URL (local directory, s3://...) to write the training bytes to as token shards and read
        them back as a stream (``examples/gpt/stream.py``) instead of the map-style windows; ``litdata``: a
        directory to write the training windows to with LitData's ``optimize`` and read them back with its
        ``StreamingDataset`` (``examples/gpt/litdata_shards.py``)."""
        super().__init__()
        self.save_hyperparameters()

    def prepare_data(self) -> None:
        if self.hparams.stream:  # once per node, before the ranks set up
            from examples.gpt.stream import write_shards

            write_shards(self.hparams.stream, self._train_bytes(), shard_tokens=8 * 1024)
        if self.hparams.litdata:
            from examples.gpt.litdata_shards import write_litdata

            write_litdata(self.hparams.litdata, self._train_bytes(), self.hparams.block_size, self.hparams.stride)

    def _train_bytes(self) -> torch.Tensor:
        raw = torch.tensor(list(Path(self.hparams.path).read_bytes()), dtype=torch.long)
        return raw[: int(0.9 * len(raw))]

    def setup(self, stage: str | None = None) -> None:
        raw = torch.tensor(list(Path(self.hparams.path).read_bytes()), dtype=torch.long)
        split = int(0.9 * len(raw))
        h = self.hparams
        self.train_set = ByteWindows(raw[:split], h.block_size, h.stride)
        self.val_set = ByteWindows(raw[split:], h.block_size, h.block_size)

    def train_dataloader(self) -> DataLoader:
        if self.hparams.litdata:
            from examples.gpt.litdata_shards import litdata_loader

            return litdata_loader(self.hparams.litdata, self.hparams.batch_size)  # type: ignore[no-any-return]
        if self.hparams.stream:
            from examples.gpt.stream import TokenShardStream

            h = self.hparams
            stream = TokenShardStream(h.stream, h.block_size, h.stride)
            return DataLoader(stream, batch_size=h.batch_size, drop_last=True)  # a pass's short end is dropped
        return DataLoader(
            self.train_set, batch_size=self.hparams.batch_size, shuffle=self.hparams.shuffle, drop_last=True
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)
