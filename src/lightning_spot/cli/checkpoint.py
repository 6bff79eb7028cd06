"""``lightning-spot checkpoint list|inspect|convert|export``: look at and export checkpoints of a run.

lightning-spot checkpoint list s3://bucket/runs/gpt --storage-options '{"endpoint_url": "..."}'
lightning-spot checkpoint inspect s3://bucket/runs/gpt [--verify] [--json]
lightning-spot checkpoint convert s3://bucket/runs/gpt model.pt     # torch.load-able, no lightning-spot needed
lightning-spot checkpoint export s3://bucket/runs/gpt model.ckpt    # MyModule.load_from_checkpoint("model.ckpt")
lightning-spot checkpoint export s3://bucket/runs/llama out/ --hf     # AutoModelForCausalLM.from_pretrained("out")
lightning-spot checkpoint export s3://bucket/runs/lora lora/ --peft   # PeftModel.from_pretrained(base, "lora")
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import torch

from lightning_spot.checkpoint.durable.read import CheckpointError, read_manifest
from lightning_spot.checkpoint.durable.storage import Storage, StorageError
from lightning_spot.checkpoint.tools.consolidate import latest_intact, load_full_state_dict
from lightning_spot.checkpoint.tools.export import export_huggingface, export_lightning
from lightning_spot.checkpoint.tools.export_peft import export_peft
from lightning_spot.layout import LayoutError, PipelineLayout, layout_label


def _storage(args: argparse.Namespace) -> Storage:
    options = json.loads(args.storage_options) if args.storage_options else {}
    return Storage(args.url, options)


def _describe(layout: dict[str, Any] | None) -> str:
    try:
        return PipelineLayout.from_dict(layout or {}).describe()
    except LayoutError:
        return f"unreadable ({layout!r})"


def _list(args: argparse.Namespace) -> int:
    storage = _storage(args)
    committed = storage.committed()
    rows = []
    for name in storage.step_dirs():
        if name in committed:
            manifest, problem = read_manifest(storage, name)
            if manifest is None:
                rows.append((name, f"unreadable manifest: {problem}"))
                continue
            rows.append(
                (
                    name,
                    f"step {manifest['step']:>8}  epoch {manifest['epoch']:>4}  {layout_label(manifest.get('layout')):<22} "
                    f"{manifest['bytes'] / 2**20:9.2f} MiB  {manifest['created']}",
                )
            )
        else:
            rows.append((name, "incomplete (no manifest: an interrupted save; not used for resuming)"))
    if not rows:
        print(f"no checkpoints under {storage.url}")
        return 1
    for name, text in rows:
        print(f"{name}  {text}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    storage = _storage(args)
    rel, manifest = latest_intact(storage)
    if args.verify:
        load_full_state_dict(storage.url_of(rel), storage.options)
    if args.json:
        print(json.dumps({k: v for k, v in manifest.items() if k not in ("lightning", "optimizer_values")}, indent=1))
        return 0
    where = storage.url_of(rel)
    data = manifest.get("data", {})
    print(f"checkpoint   {where}")
    print(f"format       {manifest['format']}   written {manifest['created']}")
    print(f"step         {manifest['step']} (epoch {manifest['epoch']}), saved because: {manifest.get('reason', '?')}")
    print(f"layout       {_describe(manifest.get('layout'))}")
    print(f"data         global batch {data.get('global_batch')}, samples consumed {data.get('samples_consumed')}")
    print(f"files        {len(manifest['files'])} files, {manifest['bytes'] / 2**20:.2f} MiB")
    timings = manifest.get("timings", {})
    print(
        f"timings      training stalled {timings.get('stall_seconds')} s, written in {timings.get('write_seconds')} s"
    )
    print(f"versions     {', '.join(f'{k} {v}' for k, v in manifest.get('versions', {}).items())}")
    for prefix, record in manifest.get("pretrained", {}).items():
        adapters = f", adapters {', '.join(record['adapters'])} (export --peft)" if "adapters" in record else ""
        print(f"model        {record['kind']} {record['class']} at `{prefix}`{adapters}")
    if args.verify:
        print("verified     the model's files match the sizes and CRC32C in the manifest")
    return 0


def _convert(args: argparse.Namespace) -> int:
    storage = _storage(args)
    weights = load_full_state_dict(storage.url, storage.options)
    torch.save(weights, args.out)
    total = sum(t.numel() for t in weights.values())
    print(f"wrote {len(weights)} tensors ({total:,} parameters) to {args.out}")
    return 0


def _export(args: argparse.Namespace) -> int:
    options = json.loads(args.storage_options) if args.storage_options else {}
    if args.peft:
        info = export_peft(args.url, args.out, adapters=args.adapter, prefix=args.prefix, storage_options=options)
        for name, where in info["adapters"].items():
            print(f"wrote adapter {name!r} of step {info['step']} to {where} (peft's PeftModel.from_pretrained)")
        return 0
    if args.hf or args.hf_config:
        info = export_huggingface(
            args.url,
            args.out,
            config=args.hf_config,
            architecture=args.architecture,
            prefix=args.prefix,
            storage_options=options,
            max_shard_size=args.max_shard_size,
        )
        print(
            f"wrote step {info['step']}: {info['tensors']} tensors ({info['bytes'] / 2**20:.1f} MiB) in "
            f"{len(info['files'])} safetensors file(s) and config.json to {args.out} (transformers' from_pretrained)"
        )
        return 0
    info = export_lightning(args.url, args.out, storage_options=options)
    print(f"wrote step {info['step']}: {info['tensors']} tensors to {args.out} (Lightning's load_from_checkpoint)")
    return 0


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-spot checkpoint", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("list", "list the checkpoints of a run directory"),
        ("inspect", "summarise the latest intact checkpoint (or the one URL names)"),
        ("convert", "write the consolidated model weights as one torch.save file"),
        (
            "export",
            "write a Lightning .ckpt (load_from_checkpoint), or with --hf a Hugging Face model directory, "
            "or with --peft the peft adapters",
        ),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("url", help="run directory or checkpoint directory (any fsspec URL)")
        if name == "convert":
            p.add_argument("out", help="output file, e.g. model.pt")
        if name == "export":
            p.add_argument("out", help="a .ckpt file, or (with --hf or --peft) a directory")
            p.add_argument(
                "--hf",
                action="store_true",
                help="a transformers model directory (class and config as recorded; a peft model's adapter merged)",
            )
            p.add_argument("--peft", action="store_true", help="the peft adapters (PeftModel.from_pretrained)")
            p.add_argument("--adapter", action="append", help="with --peft: this adapter only (repeatable)")
            p.add_argument(
                "--hf-config", help="with --hf: this save_pretrained directory's (or config.json's) config instead"
            )
            p.add_argument(
                "--architecture", help="the transformers class, e.g. LlamaForCausalLM (default: the recorded one)"
            )
            p.add_argument("--prefix", help="where the LightningModule keeps the model (default: the recorded one)")
            p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default: 5GB)")
        if name == "inspect":
            p.add_argument("--verify", action="store_true", help="also read the model weights and check their CRC32C")
            p.add_argument("--json", action="store_true", help="print the manifest as JSON")
        p.add_argument("--storage-options", default=None, help="fsspec storage options as JSON")
    args = parser.parse_args(list(argv))
    try:
        return {"list": _list, "inspect": _inspect, "convert": _convert, "export": _export}[args.command](args)
    except (CheckpointError, StorageError, FileNotFoundError) as err:
        print(f"lightning-spot checkpoint: {err}", file=sys.stderr)
        return 1
