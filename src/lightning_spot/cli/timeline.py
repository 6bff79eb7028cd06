"""``lightning-spot timeline DIR``: merge the per-rank traces a stopped run left (``rank<N>.trace.json``)
into one ``trace.json`` and draw ``timeline.png``.

    lightning-spot timeline runs/gpt/pipeline_timeline [--storage-options JSON] [--no-png]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence

import fsspec

from lightning_spot.observe.timeline import merge_traces


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-spot timeline", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("dir", help="the PipelineTimeline directory (any fsspec URL)")
    parser.add_argument("--no-png", action="store_true", help="only merge, do not draw")
    parser.add_argument("--storage-options", default=None, help="fsspec storage options as JSON")
    args = parser.parse_args(list(argv))
    fs, root = fsspec.core.url_to_fs(args.dir, **(json.loads(args.storage_options) if args.storage_options else {}))
    root = root.rstrip("/")
    try:
        names = [p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)]
    except FileNotFoundError:
        names = []
    ranks = sorted((int(m.group(1)), n) for n in names if (m := re.fullmatch(r"rank(\d+)\.trace\.json", n)))
    if not ranks:
        print(
            f"lightning-spot timeline: no rank<N>.trace.json under {args.dir} (PipelineTimeline writes them when "
            f"fit stops with an exception; a finished fit writes trace.json and timeline.png itself)",
            file=sys.stderr,
        )
        return 1
    traces = [json.loads(fs.cat_file(f"{root}/{name}")) for _, name in ranks]
    merged = merge_traces([t["traceEvents"] for t in traces], traces[0].get("metadata"))
    fs.pipe_file(f"{root}/trace.json", json.dumps(merged).encode())
    print(f"merged {len(ranks)} ranks into {args.dir.rstrip('/')}/trace.json")
    if not args.no_png:
        from lightning_spot.observe.gantt import render_gantt

        try:
            png = render_gantt(merged)
        except ImportError as err:
            print(f"lightning-spot timeline: {err}", file=sys.stderr)
            return 1
        fs.pipe_file(f"{root}/timeline.png", png)
        print(f"drew {args.dir.rstrip('/')}/timeline.png")
    return 0
