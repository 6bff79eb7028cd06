"""Export the peft adapters (LoRA and the like) of a run's checkpoint as ``PeftModel.from_pretrained`` reads them.

    export_peft("s3://bucket/run", "out/lora")   # PeftModel.from_pretrained(base_model, "out/lora")

A peft model trained in a pipeline cannot ``save_pretrained`` its adapters (each rank holds its stages' part).
The checkpoint holds all of them, and its manifest records the base model's class and config and the adapters'
configs (``durable/pretrained_record.py``): the base model is rebuilt with its adapters on the meta device, and
peft's own ``get_peft_model_state_dict`` names the adapter tensors read from the checkpoint, as
``save_pretrained`` would. Only adapter tensors are read (one stored file at a time); the base weights are not.
Adapters other than ``"default"`` go to a folder of their name, as peft saves them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from lightning_spot.checkpoint.durable import pretrained_record
from lightning_spot.checkpoint.durable.read import CheckpointError, newest_intact
from lightning_spot.checkpoint.durable.storage import Storage
from lightning_spot.checkpoint.tools.consolidate import model_groups, read_model


def export_peft(
    url: str,
    out_dir: str | Path,
    *,
    adapters: list[str] | None = None,
    prefix: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write the peft adapters (all, or those named) of the newest intact checkpoint of run ``url`` (or of the one it
    names) to ``out_dir``: ``adapter_model.safetensors`` and ``adapter_config.json`` each. ``prefix`` is where the
    LightningModule keeps the peft model (by default the only one recorded). Returns what was written."""
    from peft import PeftConfig, get_peft_model_state_dict
    from safetensors.torch import save_file

    out = Path(out_dir)
    storage = Storage(url, storage_options)

    def write(rel: str, manifest: dict[str, Any]) -> dict[str, Any]:
        at, record = pretrained_record.find(manifest, "peft", prefix)
        names = adapters or list(record["adapters"])
        unknown = sorted(set(names) - set(record["adapters"]))
        if unknown:
            raise CheckpointError(f"No adapter {unknown} in the checkpoint; it holds {sorted(record['adapters'])}.")
        model: Any = pretrained_record.meta_model(record)
        stored: dict[str, str] = dict(manifest.get("tied", {}))
        wanted = {f"{at}{n}" for n, p in model.named_parameters() if p.requires_grad}
        wanted |= {f"{at}{n}" for n in model.state_dict() if any(f".{a}." in n for a in names)}
        to_read = {stored.get(n, n) for n in wanted}
        tensors: dict[str, torch.Tensor] = {}
        for _, group in model_groups(storage, rel, manifest):
            chosen = [n for n in group if n in to_read]
            if chosen:
                tensors.update(read_model(storage, rel, manifest, chosen))
        state = {n[len(at) :]: tensors[stored.get(n, n)] for n in wanted if stored.get(n, n) in tensors}
        written = []
        for name in names:
            expected = get_peft_model_state_dict(model, adapter_name=name)
            adapter = get_peft_model_state_dict(model, state_dict=state, adapter_name=name)
            missing = sorted(set(expected) - set(adapter))
            if missing:
                raise CheckpointError(
                    f"The checkpoint lacks {len(missing)} tensor(s) of adapter {name!r}, e.g. {missing[:3]}: "
                    f"check prefix= ({at!r})."
                )
            target = out if name == "default" else out / name
            target.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in adapter.items()}, str(target / "adapter_model.safetensors"),
                      metadata={"format": "pt"})  # fmt: skip
            config = PeftConfig.from_peft_type(**record["adapters"][name])
            config.inference_mode = True
            config.save_pretrained(str(target))
            written.append(str(target))
        return {"step": manifest["step"], "adapters": dict(zip(names, written)), "tensors": len(state)}

    return newest_intact(storage, write)


class MergedAdapters:
    """The base model's weights of a peft model's checkpoint with one adapter merged in, as ``merge_and_unload``
    gives them, computed per adapted layer by peft's own ``merge`` on that layer alone (built on the CPU from the
    checkpoint's tensors): what ``export_huggingface`` writes for a peft model."""

    def __init__(self, record: dict[str, Any], at: str) -> None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        adapters = list(record["adapters"])
        if len(adapters) > 1 and "default" not in adapters:
            raise CheckpointError(
                f"The peft model holds adapters {adapters}: which to merge is not clear. Export them with --peft "
                f"(export_peft) and merge with peft's merge_and_unload."
            )
        self.adapter = "default" if "default" in adapters else adapters[0]
        self.at = at
        model = pretrained_record.meta_model(record)
        #: the adapted layers, by their names under the peft model (e.g. "base_model.model.model.layers.0.mlp.up_proj")
        self.layers: dict[str, Any] = {n: m for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)}

    def adapted(self, name: str) -> bool:
        """Whether checkpoint name ``name`` belongs to an adapted layer (read and merged by :meth:`merged_layers`)."""
        return any(name.startswith(f"{self.at}{path}.") for path in self.layers)

    def entries(self, group: dict[str, torch.Tensor]) -> Iterator[tuple[str, str | None, torch.Tensor]]:
        """(checkpoint name, name in the base model or ``None``, tensor) for stored tensors outside the adapted layers:
        a module trained whole (``modules_to_save``) under its own name, other weights as they are."""
        for name, tensor in group.items():
            rel = name[len(self.at) :] if name.startswith(self.at) else None
            if rel is not None and ".modules_to_save." in rel:  # (the adapter's copy of a module trained whole)
                chosen = f".modules_to_save.{self.adapter}."
                rel = rel.replace(chosen, ".") if chosen in rel else None
            elif rel is not None and ".original_module." in rel:
                rel = None
            yield name, _base_name(rel) if rel is not None else None, tensor

    def merged_layers(
        self, read: Callable[[list[str]], dict[str, torch.Tensor]]
    ) -> Iterator[tuple[str, str | None, torch.Tensor]]:
        """The adapted layers' ``base_layer`` weights with the adapter merged, one layer read (``read(names)``) and
        merged at a time by peft's own ``merge`` on that layer alone, built on the CPU."""
        for path, layer in self.layers.items():
            built: Any = copy.deepcopy(layer).to_empty(device="cpu")
            full = f"{self.at}{path}."
            built.load_state_dict({n[len(full) :]: t for n, t in read([full + n for n in built.state_dict()]).items()})
            built.merge(adapter_names=[self.adapter])
            for name, tensor in built.state_dict().items():
                if name.startswith("base_layer."):
                    yield f"{full}{name}", _base_name(f"{path}.{name[len('base_layer.') :]}"), tensor.detach()


def _base_name(rel: str) -> str | None:
    """A name under the peft model as the base model names it (``base_model.model.`` off), ``None`` if not in it."""
    return rel[len("base_model.model.") :] if rel.startswith("base_model.model.") else None
