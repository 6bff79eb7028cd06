"""Tiny Hugging Face causal LMs wrapped in an ordinary LightningModule (nothing pipeline-specific in it)."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

VOCAB = 96
SEQ = 16


def hf_config(family: str, tied: bool, layers: int = 4) -> Any:
    """A small random-weight config of ``family`` ("gpt2", "llama", "qwen2"), dropout off."""
    import transformers

    if family == "gpt2":
        return transformers.GPT2Config(
            n_layer=layers,
            n_embd=32,
            n_head=2,
            vocab_size=VOCAB,
            n_positions=64,
            tie_word_embeddings=tied,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    common = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": 64,
        "tie_word_embeddings": tied,
    }
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "qwen2":
        return transformers.Qwen2Config(**common)
    raise ValueError(family)


class CausalLM(L.LightningModule):
    """A Hugging Face causal LM trained on next-token prediction with AdamW, as a user would write it."""

    def __init__(self, family: str = "gpt2", tied: bool = False, layers: int = 4, lr: float = 1e-2) -> None:
        super().__init__()
        import transformers

        self.save_hyperparameters()
        torch.manual_seed(0)
        self.model = transformers.AutoModelForCausalLM.from_config(hf_config(family, tied, layers))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def token_dataset(n: int = 64, seed: int = 3) -> TensorDataset:
    """``n`` random sequences of ``SEQ`` token ids."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randint(0, VOCAB, (n, SEQ), generator=g))


def token_loader(batch_size: int = 8, n: int = 64, seed: int = 3) -> DataLoader:
    return DataLoader(token_dataset(n, seed), batch_size=batch_size)


class PretrainedCausalLM(L.LightningModule):
    """Starts from a ``save_pretrained`` directory; built on the meta device in ``configure_model``, as a
    model too large for one device must be (each rank then materialises and reads only its stages)."""

    def __init__(self, path: str, lr: float = 1e-3) -> None:
        super().__init__()
        self.path = path
        self.lr = lr
        self.model: Any = None

    def configure_model(self) -> None:
        import transformers

        if self.model is None:
            config = transformers.AutoConfig.from_pretrained(self.path)
            self.model = transformers.AutoModelForCausalLM.from_config(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        (ids,) = batch
        self.log("val_loss", self.model(input_ids=ids, labels=ids).loss)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)
