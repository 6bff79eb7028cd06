"""Export a run's checkpoint to the formats other tools load, one stored file's tensors at a time.

    export_huggingface("s3://bucket/run", "out/llama", config="checkpoints/llama-1b")  # from_pretrained("out/llama")
    export_lightning("s3://bucket/run", "out/model.ckpt")                             # MyModule.load_from_checkpoint

Both read the newest intact checkpoint of a run (or the checkpoint a URL names) one stored file at a time
(a rank's DCP shard, or a snapshot share), so the exporting process holds at most one such file's model
tensors and the output shard it is writing; the training job's ranks take no part.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lightning_spot.checkpoint import tensorfile
from lightning_spot.checkpoint.durable import pretrained_record
from lightning_spot.checkpoint.durable.read import CheckpointError, newest_intact
from lightning_spot.checkpoint.durable.storage import Storage
from lightning_spot.checkpoint.jsonstate import decode
from lightning_spot.checkpoint.tools.consolidate import model_groups, read_model
from lightning_spot.checkpoint.tools.export_peft import MergedAdapters
from lightning_spot.utils.units import parse_bytes

log = logging.getLogger(__name__)


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _hf_config(config: Any) -> Any:
    """A ``transformers`` config from a ``save_pretrained`` directory, a ``config.json`` path or a config object."""
    import transformers

    if isinstance(config, transformers.PretrainedConfig):
        return config
    path = Path(config)
    if not path.exists():
        raise CheckpointError(
            f"No Hugging Face config at {config}: pass the model's save_pretrained directory (the one "
            f"`pretrained=` read, or any with its config.json) or a transformers config object."
        )
    return transformers.AutoConfig.from_pretrained(path.parent if path.is_file() else path)


def _expected_names(config: Any, architecture: str | None) -> tuple[str, set[str]]:
    """(the architecture, the names its ``state_dict`` holds), from a model built on the meta device."""
    import transformers

    name = architecture or (config.architectures or [None])[0]
    cls = getattr(transformers, name, None) if name else None
    if cls is None:
        raise CheckpointError(
            f"Cannot tell which transformers class the checkpoint holds (config.architectures is "
            f"{config.architectures!r}). Pass architecture='LlamaForCausalLM' (the class the LightningModule built)."
        )
    with torch.device("meta"):
        model = cls(config)
    return name, set(model.state_dict())


def export_huggingface(
    url: str,
    out_dir: str | Path,
    *,
    config: Any = None,
    architecture: str | None = None,
    prefix: str | None = None,
    storage_options: dict[str, Any] | None = None,
    max_shard_size: int | str = "5GB",
) -> dict[str, Any]:
    """Write the newest intact checkpoint of run ``url`` (or the one it names) as a Hugging Face model directory:
    safetensors shards of at most ``max_shard_size``, their index, and ``config.json``. The model's class and
    config are the ones the checkpoint recorded, unless ``config`` (a ``save_pretrained`` directory, config.json or
    config object) and ``architecture`` are given. ``prefix`` is where the LightningModule keeps the transformers
    model (``self.model``: ``"model."``; by default the recorded one). A tied weight is written once, as
    ``save_pretrained`` writes it; ``from_pretrained`` ties it again. Returns what was written."""
    limit = parse_bytes(max_shard_size) or 5 * 10**9
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    storage = Storage(url, storage_options)

    def write(rel: str, manifest: dict[str, Any]) -> dict[str, Any]:
        nonlocal config, architecture, prefix
        merged = None
        if config is None:
            kinds = {r["kind"] for p, r in manifest.get("pretrained", {}).items() if prefix in (None, p)}
            prefix, record = pretrained_record.find(manifest, "peft" if kinds == {"peft"} else "transformers", prefix)
            config, architecture = pretrained_record.hf_config(record), architecture or record["class"]
            if record["kind"] == "peft":  # the base model with the adapter merged in
                merged = MergedAdapters(record, prefix)
        prefix = "model." if prefix is None else prefix
        config = _hf_config(config)
        architecture, expected = _expected_names(config, architecture)
        aliases = set(manifest.get("tied", {}))
        shards: list[list[str]] = []
        current: dict[str, torch.Tensor] = {}
        peak = written = 0
        found: set[str] = set()

        def flush() -> None:
            from safetensors.torch import save_file

            if current:
                save_file(current, str(out / f".part-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
                shards.append(sorted(current))
                current.clear()

        base = prefix if merged is None else f"{prefix}base_model.model."  # (where the base model's names start)

        def read(names: list[str]) -> dict[str, torch.Tensor]:
            nonlocal peak
            group = read_model(storage, rel, manifest, names)
            peak = max(peak, _nbytes(group) + _nbytes(current))
            return group

        def groups() -> Iterator[list[tuple[str, str | None, torch.Tensor]]]:
            """(checkpoint name, name in the model, tensor) per stored file, then (peft) per merged layer."""
            for _, names in model_groups(storage, rel, manifest):
                if merged is None:
                    yield [(n, n[len(prefix) :] if n.startswith(prefix) else None, t) for n, t in read(names).items()]
                elif kept := [n for n in names if not merged.adapted(n)]:
                    yield list(merged.entries(read(kept)))
            if merged is not None:
                yield from ([entry] for entry in merged.merged_layers(read))

        for entries in groups():
            for name, key, tensor in entries:
                if name in aliases or key is None:  # tied copies are written once; other modules are not the model
                    continue
                if key not in expected:
                    raise CheckpointError(
                        f"`{name}` of the checkpoint is not a weight of {architecture} as `{key}`. Check prefix= (where "
                        f"the LightningModule keeps the model; {prefix!r} now) and the config."
                    )
                tensor = tensor.contiguous()
                if current and _nbytes(current) + _nbytes({key: tensor}) > limit:
                    flush()
                current[key] = tensor
                found.add(key)
                written += _nbytes({key: tensor})
            del entries
        flush()
        missing = expected - found - {k[len(base) :] for k in aliases if k.startswith(base)}
        if missing:
            raise CheckpointError(
                f"The checkpoint lacks {len(missing)} weight(s) of {architecture}, e.g. {sorted(missing)[:3]}. Check "
                f"prefix= ({prefix!r}) and that the config is the trained model's."
            )
        files = _name_shards(out, shards, written)
        config.architectures = [architecture]
        config.save_pretrained(out)
        return {"step": manifest["step"], "files": files, "tensors": len(found), "bytes": written, "peak_bytes": peak}

    return newest_intact(storage, write)


def _name_shards(out: Path, shards: list[list[str]], total: int) -> list[str]:
    """Rename the written parts as ``save_pretrained`` names them; write the index when there are several."""
    if len(shards) == 1:
        os.replace(out / ".part-00000.safetensors", out / "model.safetensors")
        return ["model.safetensors"]
    files, weight_map = [], {}
    for i, keys in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(out / f".part-{i:05d}.safetensors", out / name)
        files.append(name)
        weight_map.update(dict.fromkeys(keys, name))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return files


def export_lightning(
    url: str, out_path: str | Path, *, storage_options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Write the newest intact checkpoint of run ``url`` (or the one it names) as one Lightning ``.ckpt`` that
    ``MyModule.load_from_checkpoint`` (or ``torch.load``) reads without lightning-spot: the weights under every
    name (tied ones too), the hyper-parameters, epoch and step. Optimizer state is left out (resume training
    from the run itself, on any layout). The weights pass through temporary files in ``out_path``'s folder,
    mapped into memory while ``torch.save`` writes them, so the process holds one stored file's tensors."""
    import lightning

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    storage = Storage(url, storage_options)

    def write(rel: str, manifest: dict[str, Any]) -> dict[str, Any]:
        staging = Path(tempfile.mkdtemp(prefix=".export-", dir=out.parent))
        maps: list[mmap.mmap] = []
        weights: dict[str, torch.Tensor] = {}
        try:
            peak = 0
            for i, (_, names) in enumerate(model_groups(storage, rel, manifest)):
                group = read_model(storage, rel, manifest, names)
                peak = max(peak, _nbytes(group))
                path = staging / f"{i:05d}{tensorfile.SUFFIX}"
                tensorfile.write_file(path, {"model": group})
                del group
                with open(path, "rb") as f:  # a private mapping: pages come from the file, never copied
                    maps.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY))
                weights.update(tensorfile.decode(memoryview(maps[-1]), str(path)).get("model", {}))
            for alias, name in manifest.get("tied", {}).items():
                if name in weights:
                    weights[alias] = weights[name]
            state = {k: decode(v) for k, v in manifest.get("lightning", {}).items() if k in _LIGHTNING_KEYS}
            if "hyper_parameters" not in state:
                log.warning(
                    "lightning-spot: %s holds no hyper-parameters (saved before they were kept, or not JSON): "
                    "load_from_checkpoint will need them as arguments",
                    storage.url_of(rel),
                )
            checkpoint = {
                **state,
                "epoch": manifest.get("epoch", state.get("epoch", 0)),
                "global_step": manifest["step"],
                "pytorch-lightning_version": lightning.__version__,
                "state_dict": weights,
            }
            torch.save(checkpoint, out)
            return {"step": manifest["step"], "tensors": len(weights), "path": str(out), "peak_bytes": peak}
        finally:
            weights.clear()
            for m in maps:
                try:
                    m.close()
                except BufferError:  # a tensor still views it: the mapping goes with the tensor
                    pass
            shutil.rmtree(staging, ignore_errors=True)

    return newest_intact(storage, write)


#: what of Lightning's checkpoint ``load_from_checkpoint`` needs besides the weights
_LIGHTNING_KEYS = ("hyper_parameters", "hparams_name", "datamodule_hyper_parameters", "datamodule_hparams_name")
