"""``save_pretrained`` on a model split into pipeline stages is refused by name: it would write this rank's part.

A transformers or peft model whose layers are spread over pipeline stages holds only this rank's layers (the
others are ``SkippedLayer`` placeholders), so its ``save_pretrained`` (and ``push_to_hub``, which calls it) would
write a partial model or adapter without a word, and loading it would put fresh weights where the other stages'
trained ones belong. Placement replaces the method on each such instance with one that names the way out: export
the trained model from a checkpoint of the run (``lightning-spot checkpoint export``).
"""

from __future__ import annotations

from typing import Any, NoReturn

from torch import nn

from lightning_spot.partition.discovery import ModelContractError


def instance_named(obj: Any, *class_names: str) -> bool:
    """Whether ``obj`` is an instance of a class named so (by name: transformers and peft may not be installed)."""
    return any(c.__name__ in class_names for c in type(obj).__mro__)


def refuse_partial_saves(module: nn.Module, where: str) -> None:
    """Make ``save_pretrained`` of every transformers/peft model in ``module`` raise; ``where`` says what this
    rank holds (e.g. "stage 0 (layers 0-1) of 2; 4 layers in all")."""
    for name, sub in module.named_modules():
        if instance_named(sub, "PreTrainedModel", "PeftModel"):
            kind = "adapters" if instance_named(sub, "PeftModel") else "model"
            sub.__dict__["save_pretrained"] = _Refusal(name or type(module).__name__, kind, where)


class _Refusal:
    """Stands in for ``save_pretrained`` on a rank that holds part of the model."""

    def __init__(self, name: str, kind: str, where: str) -> None:
        self.name, self.kind, self.where = name, kind, where

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        flag, api = (
            ("--peft", "export_peft.export_peft") if self.kind == "adapters" else ("--hf", "export.export_huggingface")
        )
        raise ModelContractError(
            f"`{self.name}.save_pretrained()` would write only what this rank holds ({self.where}): the model is "
            f"split into pipeline stages, and the saved {self.kind} would load with fresh weights in place of the "
            f"other stages' trained ones. Export the trained {self.kind} from a checkpoint of the run instead: "
            f"`trainer.save_checkpoint(path)` on every rank (or the SpotCheckpoint/ModelCheckpoint directory), "
            f"then `lightning-spot checkpoint export PATH OUT {flag}` (in Python: "
            f"lightning_spot.checkpoint.tools.{api})."
        )
