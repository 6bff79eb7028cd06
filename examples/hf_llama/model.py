"""A Hugging Face Llama as an ordinary LightningModule: nothing in it is pipeline-specific.

The model is built in ``configure_model`` (on the meta device under ``spot_pipeline``, so no rank ever
holds all of it): from a small random-init config by default, or from the config of a pretrained
checkpoint whose weights the strategy then reads per stage (``SpotPipelineStrategy(pretrained=...)``).
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch


class LlamaLM(L.LightningModule):
    """Next-token prediction with ``transformers``' ``LlamaForCausalLM``.

    Args:
        pretrained: a ``save_pretrained`` directory whose config to use (pass the same directory to
            ``SpotPipelineStrategy(pretrained=...)`` for its weights); ``None``: the small config below.
        vocab_size / hidden_size / layers / heads: the random-init config (bytes: vocabulary 256).
    """

    def __init__(
        self,
        pretrained: str | None = None,
        vocab_size: int = 256,
        hidden_size: int = 128,
        layers: int = 4,
        heads: int = 4,
        tie_word_embeddings: bool = True,
        lr: float = 1e-3,
        max_steps: int = 120,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: Any = None

    def configure_model(self) -> None:
        import transformers

        if self.model is not None:
            return
        h = self.hparams
        if h.pretrained:
            config = transformers.AutoConfig.from_pretrained(h.pretrained)
        else:
            config = transformers.LlamaConfig(
                vocab_size=h.vocab_size,
                hidden_size=h.hidden_size,
                intermediate_size=4 * h.hidden_size,
                num_hidden_layers=h.layers,
                num_attention_heads=h.heads,
                num_key_value_heads=h.heads,
                max_position_embeddings=512,
                tie_word_embeddings=h.tie_word_embeddings,
            )
        self.model = transformers.AutoModelForCausalLM.from_config(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, _ = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        ids, _ = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("val_loss", loss, prog_bar=True)
        self.log("val_ppl", torch.exp(loss))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)
        warmup, total = 10, max(self.hparams.max_steps, 11)

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup))))

        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)}
