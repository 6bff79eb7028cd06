"""What a checkpoint's manifest records of the ``transformers`` and ``peft`` models a LightningModule holds.

    manifest["pretrained"] = describe(module)   # {"model.": {"kind": "peft", "class": "LlamaForCausalLM", ...}}
    prefix, record = find(manifest, "peft")    # at export time, without the module
    base = meta_model(record)                  # the model rebuilt on the meta device from the recorded config

With it, an export needs nothing but the run: the class and config of a transformers model (what
``from_pretrained`` needs next to the weights), and for a peft model the adapters' configs as well.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from lightning_spot.checkpoint.durable.read import CheckpointError
from lightning_spot.partition.partial_saves import instance_named


def _jsonable(value: dict[str, Any]) -> dict[str, Any]:
    """A config's dict with sets as sorted lists and other objects as strings (peft's ``target_modules``)."""

    def other(obj: Any) -> Any:
        return sorted(obj) if isinstance(obj, (set, frozenset)) else str(obj)

    result: dict[str, Any] = json.loads(json.dumps(value, default=other))
    return result


def _config(model: Any) -> dict[str, Any]:
    return _jsonable(model.config.to_dict())


def describe(module: nn.Module | None) -> dict[str, Any]:
    """Each outermost transformers ``PreTrainedModel`` or peft ``PeftModel`` of ``module``, by the prefix of its
    names in the checkpoint (``"model."``): its class, config and (peft) adapter configs. Empty without any."""
    found: dict[str, Any] = {}
    if module is None:
        return found
    for name, sub in module.named_modules():
        prefix = f"{name}." if name else ""
        if any(prefix.startswith(p) for p in found):
            continue
        if instance_named(sub, "PeftModel"):
            base = sub.get_base_model()
            adapters = {a: _jsonable(c.to_dict()) for a, c in sub.peft_config.items()}
            for config in adapters.values():
                config["base_model_name_or_path"] = config.get("base_model_name_or_path") or (
                    getattr(base, "name_or_path", None) or None
                )
            found[prefix] = {
                "kind": "peft",
                "class": type(base).__name__,
                "config": _config(base),
                "adapters": adapters,
            }
        elif instance_named(sub, "PreTrainedModel"):
            found[prefix] = {"kind": "transformers", "class": type(sub).__name__, "config": _config(sub)}
    return found


def find(manifest: dict[str, Any], kind: str, prefix: str | None = None) -> tuple[str, dict[str, Any]]:
    """(prefix, record) of the ``kind`` ("transformers" or "peft") model the checkpoint recorded at ``prefix``, or
    of the only one; a :class:`CheckpointError` that says what there is otherwise."""
    recorded = manifest.get("pretrained", {})
    matches = {p: r for p, r in recorded.items() if r["kind"] == kind and prefix in (None, p)}
    if len(matches) == 1:
        return next(iter(matches.items()))
    held = ", ".join(f"{r['kind']} {r['class']} at `{p}`" for p, r in recorded.items()) or "none recorded"
    if not recorded:
        held += " (written before checkpoints recorded their models, or the module holds no such model)"
    if len(matches) > 1:
        fix = "Pass the prefix of one of them."
    elif kind == "transformers" and any(r["kind"] == "peft" for r in recorded.values()):
        fix = (
            "For the peft model: --peft (export_peft) writes its adapters, --hf alone the base model with them merged."
        )
    else:
        fix = "Check the prefix, or pass the model's config."
    where = f" at prefix {prefix!r}" if prefix else ""
    raise CheckpointError(f"Cannot tell which {kind} model to export{where}: the checkpoint holds {held}. {fix}")


def hf_config(record: dict[str, Any]) -> Any:
    """The transformers config object of a record."""
    import transformers

    config = dict(record["config"])
    return transformers.AutoConfig.for_model(config.pop("model_type"), **config)


def meta_model(record: dict[str, Any], config: Any = None) -> nn.Module:
    """The recorded model (with its peft adapters for a peft record) built on the meta device: names, no memory."""
    import transformers

    cls = getattr(transformers, record["class"], None)
    if cls is None:
        raise CheckpointError(
            f"transformers {transformers.__version__} has no class {record['class']} (the checkpoint's model): "
            f"install the version that trained it."
        )
    with torch.device("meta"):
        model = cls(config if config is not None else hf_config(record))
        if record["kind"] == "peft":
            from peft import PeftConfig, get_peft_model

            adapters = record["adapters"]
            first, *others = adapters
            model = get_peft_model(model, PeftConfig.from_peft_type(**adapters[first]), adapter_name=first)
            for name in others:
                model.add_adapter(name, PeftConfig.from_peft_type(**adapters[name]))
    return model
