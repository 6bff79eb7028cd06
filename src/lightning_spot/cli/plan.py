"""``lightning-spot plan``: profile a model and print the layout the planner would choose.

    lightning-spot plan --model my_pkg.models:GPT --init-args '{"n_layer": 24}' \\
        --world-size 16 --device-memory 80GB --global-batch 512 --input-shape 4x2048 --input-dtype int64 --input-high 50000

The model is built on the meta device (``__init__`` and ``configure_model``); each layer is then
materialised and profiled on its own, so models larger than the local device can be planned.
Forward inputs come from the model's ``example_input_array`` or from ``--input-shape`` (its first
dimension is the micro-batch the profile is measured at).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from typing import Any

import torch

from lightning_spot.layout import LayoutError
from lightning_spot.partition.discovery import ModelContractError, discover
from lightning_spot.planning.cost_model import OFFLOAD_CHOICES, plan_layouts
from lightning_spot.planning.hardware import Hardware
from lightning_spot.planning.mixed import plan_mixed
from lightning_spot.planning.profile import profile_model
from lightning_spot.utils.units import format_bytes, parse_bytes


def _load(spec: str, init_args: dict[str, Any]) -> torch.nn.Module:
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise SystemExit(f"--model must look like 'package.module:ClassName', got {spec!r}")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise SystemExit(f"lightning-spot plan: cannot import {spec!r}: {err}") from err
    with torch.device("meta"):
        model = cls(**init_args)
        configure = getattr(model, "configure_model", None)
        if callable(configure):
            configure()
    return model


def _inputs(model: torch.nn.Module, args: argparse.Namespace) -> tuple:
    if args.input_shape:
        shape = [int(x) for x in args.input_shape.lower().split("x")]
        dtype = getattr(torch, args.input_dtype)
        if dtype.is_floating_point:
            return (torch.randn(shape, dtype=dtype),)
        return (torch.randint(0, args.input_high, shape, dtype=dtype),)
    example = getattr(model, "example_input_array", None)
    if example is None:
        raise SystemExit(
            "lightning-spot plan needs forward inputs: define `example_input_array` on the model (one micro-batch), "
            "or pass --input-shape (e.g. 4x2048) with --input-dtype and, for token ids, --input-high."
        )
    return tuple(example) if isinstance(example, (tuple, list)) else (example,)


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(
        prog="lightning-spot plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", required=True, help="package.module:ClassName of the LightningModule")
    p.add_argument("--init-args", default="{}", help="JSON keyword arguments for the class")
    p.add_argument("--layers", default="auto", help="attribute path of the layer sequence (default: found)")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--device-memory", required=True, help="memory per device, e.g. 80GB")
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--input-shape", help="one micro-batch of forward input, e.g. 4x2048")
    p.add_argument("--input-dtype", default="float32")
    p.add_argument("--input-high", type=int, default=2, help="token ids are drawn below this")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where to profile")
    p.add_argument("--p2p-gbps", type=float, default=None, help="point-to-point bandwidth, GB/s")
    p.add_argument("--allreduce-gbps", type=float, default=None, help="all-reduce bandwidth, GB/s")
    p.add_argument("--host-memory", help="host memory per device for offloaded state, e.g. 200GB (default: unknown)")
    p.add_argument("--no-offload", action="store_true", help="keep all training state on the devices")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(list(argv))

    try:
        model = _load(args.model, json.loads(args.init_args))
        split = discover(model, args.layers)
        inputs = _inputs(model, args)
        device = torch.device(args.device)
        profile = profile_model(
            model,
            split,
            tuple(t.to(device) for t in inputs),
            device=device,
            samples=int(inputs[0].shape[0]),
            progress=not args.json,
        )
        hw = Hardware(memory_bytes=parse_bytes(args.device_memory), host_memory_bytes=parse_bytes(args.host_memory))
        if args.p2p_gbps:
            hw = Hardware(**{**hw.__dict__, "p2p_bytes_per_s": args.p2p_gbps * 1e9})
        if args.allreduce_gbps:
            hw = Hardware(**{**hw.__dict__, "allreduce_bytes_per_s": args.allreduce_gbps * 1e9})
        mixes = plan_mixed(profile, world_size=args.world_size, global_batch=args.global_batch, hardware=hw)
        try:
            candidates = plan_layouts(
                profile,
                world_size=args.world_size,
                global_batch=args.global_batch,
                hardware=hw,
                offloads=((),) if args.no_offload else OFFLOAD_CHOICES,
            )
        except LayoutError:
            if not mixes:
                raise
            if args.json:
                print(json.dumps({"mixed": mixes[0].to_dict(), "runner_ups": [m.to_dict() for m in mixes[1:4]]}))
                return 0
            print(f"no uniform layout of {args.world_size} devices fits; pipelines of mixed depths do:")
            for m in mixes[:4]:
                print(f"  {m.describe()}")
            return 0
    except (LayoutError, ModelContractError) as err:
        print(f"lightning-spot plan: {err}", file=sys.stderr)
        return 1
    best, runners = candidates[0], candidates[1:4]
    if args.json:
        print(
            json.dumps(
                {
                    **best.to_dict(),
                    "runner_ups": [c.to_dict() for c in runners],
                    "mixed": mixes[0].to_dict() if mixes else None,
                    "profile": {"samples": profile.samples, "device": profile.device, "layers": len(profile.layers)},
                }
            )
        )
        return 0
    print(
        f"best layout for {args.world_size} devices of {format_bytes(hw.memory_bytes)}, global batch {args.global_batch}:"
    )
    print(f"  {best.describe()}")
    bounds = [0, *best.cuts, len(profile.layers)]
    for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
        extra = " + before the sequence" if s == 0 else ""
        extra += " + after the sequence and the loss" if s == len(bounds) - 2 else ""
        print(
            f"  stage {s}: layers {a}-{b - 1}{extra}: {best.stage_seconds[s] * 1000:.1f} ms/step, {format_bytes(best.stage_bytes[s])}"
        )
    print(f"  predicted step: {best.predicted_step_seconds * 1000:.1f} ms ({best.samples_per_second:.1f} samples/s)")
    for c in runners:
        print(f"  runner-up: {c.describe()}")
    if not args.no_offload:
        without = next((c for c in candidates if not c.offload), None)
        offloaded = next((c for c in candidates if c.offload), None)
        for label, found in (("without offload", without), ("with offload", offloaded)):
            print(f"  {label}: {found.describe() if found is not None else 'no layout fits'}")
    if mixes:
        faster = mixes[0].predicted_step_seconds < best.predicted_step_seconds
        verdict = "predicted faster than the best uniform layout" if faster else "not faster"
        print(f"  pipelines of mixed depths, best: {mixes[0].describe()} ({verdict})")
    return 0
