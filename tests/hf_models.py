"""Tiny Hugging Face causal LMs wrapped in an ordinary LightningModule (nothing pipeline-specific in it)."""

from __future__ import annotations

from typing import Any, ClassVar

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

VOCAB = 96
SEQ = 16


def hf_config(family: str, tied: bool, layers: int = 4) -> Any:
    """A small random-weight config of ``family`` ("gpt2", "llama", "qwen2", "mixtral", "mixtral-router-logits",
    "falcon", "bloom"), dropout off."""
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
    if family in ("mixtral", "mixtral-router-logits"):  # the latter adds the experts' load-balancing loss
        router_logits = family == "mixtral-router-logits"
        return transformers.MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, output_router_logits=router_logits
        )
    if family == "falcon":  # (Falcon's and Bloom's blocks return tuples)
        return transformers.FalconConfig(
            hidden_size=32, num_hidden_layers=layers, num_attention_heads=2, vocab_size=VOCAB, tie_word_embeddings=tied
        )
    if family == "bloom":
        return transformers.BloomConfig(
            hidden_size=32, n_layer=layers, n_head=2, vocab_size=VOCAB, tie_word_embeddings=tied
        )
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


class Sampling(CausalLM):
    """``CausalLM`` that writes samples at each validation's end, as users watch a language model learn:
    ``generate`` in a hook, on every rank."""

    PROMPT: ClassVar[list[list[int]]] = [[1, 2, 3], [4, 5, 6]]

    def __init__(self, family: str = "llama", tied: bool = False, layers: int = 4, lr: float = 1e-2) -> None:
        super().__init__(family, tied, layers, lr)
        self.samples: list[list[list[int]]] = []

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        (ids,) = batch
        self.log("val_loss", self.model(input_ids=ids, labels=ids).loss)

    def on_validation_epoch_end(self) -> None:
        self.samples.append(self.sample(do_sample=False))

    def sample(self, **options: Any) -> list[list[int]]:
        with torch.no_grad():
            out = self.model.generate(torch.tensor(self.PROMPT), max_new_tokens=5, pad_token_id=0, **options)
        return out.tolist()  # type: ignore[no-any-return]


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


# ------------------------------------------------------------------ fine-tuning batches: padding and masked labels
PAD, MASK = 0, 1
CLASSES = 3


def padded_dataset(task: str, n: int = 32, seed: int = 5) -> list[dict[str, torch.Tensor]]:
    """``n`` padded samples of ``SEQ`` tokens whose real lengths vary from 2 to ``SEQ`` (so micro-batches hold
    different numbers of real tokens), as a fine-tuning collator gives them:

    - ``"sft"``: causal-LM fine-tuning; labels are the ids with the prompt (1 to 4 tokens) and the padding
      set to -100;
    - ``"mlm"``: masked LM; about a third of the real tokens replaced by ``MASK`` and labelled, the rest -100;
    - ``"classify"``: one class per sequence.
    """
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        length = int(torch.randint(2, SEQ + 1, (), generator=g))
        real = torch.arange(SEQ) < length
        ids = torch.where(real, torch.randint(2, VOCAB, (SEQ,), generator=g), PAD)
        sample = {"input_ids": ids, "attention_mask": real.long()}
        if task == "sft":
            prompt = int(torch.randint(1, min(4, length - 1) + 1, (), generator=g))
            sample["labels"] = torch.where(real & (torch.arange(SEQ) >= prompt), ids, -100)
        elif task == "mlm":
            chosen = real & (torch.rand(SEQ, generator=g) < 0.35)
            chosen[int(torch.randint(0, length, (), generator=g))] = True  # at least one labelled token
            sample["input_ids"] = torch.where(chosen, MASK, ids)
            sample["labels"] = torch.where(chosen, ids, -100)
        elif task == "classify":
            sample["labels"] = torch.randint(0, CLASSES, (), generator=g)
        else:
            raise ValueError(task)
        samples.append(sample)
    return samples


def padded_loader(task: str, batch_size: int = 8, n: int = 32, seed: int = 5) -> DataLoader:
    return DataLoader(padded_dataset(task, n, seed), batch_size=batch_size)  # type: ignore[arg-type]


def fine_tune_model(family: str, kind: str, tied: bool = False, layers: int = 4) -> Any:
    """A tiny random-weight transformers model for ``kind`` ("causal", "masked", "classify"), dropout off."""
    import transformers

    if family == "bert":
        config = transformers.BertConfig(
            hidden_size=32,
            num_hidden_layers=layers,
            num_attention_heads=2,
            intermediate_size=64,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            tie_word_embeddings=tied,
            num_labels=CLASSES,
            pad_token_id=PAD,
        )
    elif family == "opt":
        config = transformers.OPTConfig(
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=layers,
            num_attention_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            layerdrop=0.0,
            tie_word_embeddings=tied,
            num_labels=CLASSES,
            pad_token_id=PAD,
        )
    else:
        config = hf_config(family, tied, layers)
        config.num_labels, config.pad_token_id = CLASSES, PAD
    auto = {
        "causal": transformers.AutoModelForCausalLM,
        "masked": transformers.AutoModelForMaskedLM,
        "classify": transformers.AutoModelForSequenceClassification,
    }[kind]
    return auto.from_config(config)


class FineTune(L.LightningModule):
    """Fine-tuning on padded batches with masked labels, as a user writes it: ``self.model(**batch).loss``.

    ``loss="mean"``: a hand-written causal-LM loss instead, a cross-entropy averaged over the labels that are not
    -100 (a mean over a varying count nobody declares); ``loss="counted"``: the same, returned with its count.
    ``scheduler``: the learning rate halves after every epoch (StepLR). ``epoch_mean``: the model's loss is logged
    as the epoch's mean too, and the labelled tokens through a ``torchmetrics.SumMetric`` (on steps and epochs).
    """

    def __init__(
        self,
        family: str = "llama",
        kind: str = "causal",
        tied: bool = False,
        lr: float = 1e-2,
        loss: str = "model",
        scheduler: bool = False,
        epoch_mean: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.model = fine_tune_model(family, kind, tied)
        if epoch_mean:
            import torchmetrics

            self.tokens = torchmetrics.SumMetric()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        if self.hparams.loss == "model":
            loss = self.model(**batch).loss
            self.log("train_loss", loss)
            if self.hparams.epoch_mean:  # the epoch's mean as well, and a metric object: labelled tokens
                self.log("train_loss_epoch", loss, on_step=False, on_epoch=True)
                self.tokens((batch["labels"] != -100).sum())
                self.log("tokens", self.tokens, on_step=True, on_epoch=True)
            return loss
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        labels = batch["labels"][:, 1:]
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100)
        self.log("train_loss", loss)
        if self.hparams.loss == "counted":
            return {"loss": loss, "num_items": (labels != -100).sum()}
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.model(**batch).loss)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        if self.hparams.scheduler:
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}
        return opt


class LoRA(FineTune):
    """``FineTune`` with peft's LoRA (r=4 on the attention projections), the base model frozen: padded batches whose
    prompt and padding are masked out of the labels, as instruction tuning with adapters is written."""

    TARGETS: ClassVar[dict[str, list[str]]] = {"gpt2": ["c_attn"], "llama": ["q_proj", "v_proj"]}

    def __init__(self, family: str = "llama", kind: str = "causal", tied: bool = False, lr: float = 3e-3) -> None:
        super().__init__(family, kind, tied, lr)
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=4, lora_alpha=8, target_modules=self.TARGETS[family], init_lora_weights="gaussian")
        self.model = get_peft_model(self.model, config)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.hparams.lr)


class Preference(L.LightningModule):
    """Preference tuning as DPO-style code writes it: the model runs twice per step, on the chosen answer (the
    sample's labelled tokens) and on a rejected one (those tokens shifted by one id), and the loss is
    ``-log sigmoid(beta * margin)``, the margin being the difference of the answers' summed token log-probabilities
    (prompt and padding masked). Batches of :func:`padded_dataset` ``("sft")``."""

    def __init__(self, family: str = "gpt2", tied: bool = True, lr: float = 1e-3) -> None:
        super().__init__()
        import transformers

        self.save_hyperparameters()
        torch.manual_seed(0)
        self.model = transformers.AutoModelForCausalLM.from_config(hf_config(family, tied))

    def answer_log_prob(self, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        targets = labels[:, 1:]
        token = logits.log_softmax(-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return (token * (targets != -100)).sum(-1)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
        answer = labels != -100
        rejected = torch.where(answer, (ids + 1) % VOCAB, ids)
        margin = self.answer_log_prob(ids, mask, labels) - self.answer_log_prob(
            rejected, mask, torch.where(answer, rejected, -100)
        )
        loss = -torch.nn.functional.logsigmoid(0.5 * margin).mean()
        self.log("train_loss", loss)
        self.log("margin", margin.mean())
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


#: the block sequence of each family's model, as found by discovery
LAYERS = {"gpt2": "model.transformer.h", "llama": "model.model.layers", "qwen2": "model.model.layers"}
