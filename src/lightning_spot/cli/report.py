"""``lightning-spot report RUN_URL``: what happened to a run — layouts, preemptions, time lost, the useful-time
share, checkpoint stall, throughput per layout, and (with prices) what it cost — as text (or JSON) and a PNG
timeline.

    lightning-spot report s3://bucket/runs/gpt --png run.png --storage-options '{"endpoint_url": "..."}'
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from lightning_spot.checkpoint.durable.storage import Storage, StorageError
from lightning_spot.observe.cost import Prices, format_cost, run_cost
from lightning_spot.observe.job_report import build_job_report, format_job_report
from lightning_spot.observe.run_report import build_report, format_report, pipeline_histories, render_run_timeline


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-spot report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("url", help="the run directory: SpotCheckpoint's dirpath (any fsspec URL)")
    parser.add_argument("--png", type=Path, help="also draw the run's timeline into this PNG file")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--storage-options", default=None, help="fsspec storage options as JSON")
    parser.add_argument(
        "--cost", action="store_true", help="add the cost section (example prices unless given; see docs)"
    )
    parser.add_argument("--spot-price", type=float, help="spot dollars per GPU-hour (implies --cost)")
    parser.add_argument("--on-demand-price", type=float, help="on-demand dollars per GPU-hour (implies --cost)")
    parser.add_argument("--tokens-per-sample", type=int, help="quote dollars per million tokens instead of samples")
    args = parser.parse_args(list(argv))
    try:
        storage = Storage(args.url, json.loads(args.storage_options) if args.storage_options else {})
        report = build_report(storage)
    except FileNotFoundError as err:
        if not pipeline_histories(storage):
            print(f"lightning-spot report: {err}", file=sys.stderr)
            return 1
        return _job(storage, args)  # a fault-tolerant run: one history per pipeline
    except StorageError as err:
        print(f"lightning-spot report: {err}", file=sys.stderr)
        return 1
    cost = None
    if args.cost or args.spot_price is not None or args.on_demand_price is not None:
        defaults = Prices()
        prices = Prices(
            spot_per_gpu_hour=args.spot_price if args.spot_price is not None else defaults.spot_per_gpu_hour,
            on_demand_per_gpu_hour=args.on_demand_price
            if args.on_demand_price is not None
            else defaults.on_demand_per_gpu_hour,
            tokens_per_sample=args.tokens_per_sample,
        )
        cost = run_cost(report, prices)
    if args.json:
        print(json.dumps({**report, **({"cost": cost} if cost else {})}, indent=1))
    else:
        print(format_report(report))
        if cost:
            print("\n" + format_cost(cost))
    if args.png:
        try:
            args.png.write_bytes(render_run_timeline(report))
        except ImportError as err:
            print(f"lightning-spot report: {err}", file=sys.stderr)
            return 1
        if not args.json:
            print(f"\ntimeline written to {args.png}")
    return 0


def _job(storage: Storage, args: argparse.Namespace) -> int:
    """The report of a fault-tolerant run directory: each pipeline's line and the job's GPU-time efficiency."""
    job = build_job_report(storage)
    if args.png or args.cost or args.spot_price is not None or args.on_demand_price is not None:
        print(
            "lightning-spot report: --png and the cost section are per pipeline for a fault-tolerant run: "
            f"lightning-spot report {storage.url.rstrip('/')}/{next(iter(job['pipelines']))} ...",
            file=sys.stderr,
        )
        return 1
    print(json.dumps(job, indent=1) if args.json else format_job_report(job))
    return 0
