"""A small GPT-style byte-level language model: an ordinary LightningModule.

Nothing here knows about pipelines: ``forward`` runs the embeddings, the ``layers`` sequence of
transformer blocks, then the final norm and head. Under ``strategy="spot_pipeline"`` the
embeddings go to the first stage, the blocks are cut into stages and the head goes to the last.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.text import Perplexity


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-norm transformer block: attention then MLP, each with a residual connection."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(L.LightningModule):
    """Byte-level GPT. Modules are created in ``configure_model`` so that large configurations can be
    built on the meta device and materialised stage by stage."""

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 64,
        d_model: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 20,
        max_steps: int = 1000,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.train_ppl = Perplexity()
        self.val_ppl = Perplexity()

    def configure_model(self) -> None:
        if hasattr(self, "layers"):
            return
        h = self.hparams
        self.tok_emb = nn.Embedding(h.vocab_size, h.d_model)
        self.pos_emb = nn.Embedding(h.block_size, h.d_model)
        self.layers = nn.Sequential(*[Block(h.d_model, h.n_head) for _ in range(h.n_layer)])
        self.ln_f = nn.LayerNorm(h.d_model)
        self.head = nn.Linear(h.d_model, h.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        x = self.layers(x)
        return self.head(self.ln_f(x))

    def _loss(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()), logits.float(), y

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, logits, y = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_ppl", self.train_ppl(logits, y), prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss, logits, y = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True)
        self.log("val_ppl", self.val_ppl(logits, y), prog_bar=True)

    def configure_optimizers(self) -> Any:
        h = self.hparams
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": h.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=h.lr,
            betas=(0.9, 0.95),
        )

        def schedule(step: int) -> float:
            if step < h.warmup_steps:
                return (step + 1) / h.warmup_steps
            progress = min(1.0, (step - h.warmup_steps) / max(1, h.max_steps - h.warmup_steps))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
