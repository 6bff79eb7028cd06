"""What a LitData resume costs in the sharded mode: the time to the first batch of a pass read in LitData's own
order, against the first batch after a resume onto another number of replicas (LitData's elastic path, which lists
the pass's items in every worker).

    python benchmarks/litdata_resume.py                   # 200,000 items
    python benchmarks/litdata_resume.py --items 1000000

Needs LitData (``pip install --no-deps litdata==0.2.76``). The dataset (one int32 per item, chunks of 2048) is
written once under ``--root``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_spot.data.streams import stream_dataloader


def write(directory: Path, items: int) -> str:
    from litdata.streaming.writer import BinaryWriter

    if not (directory / "index.json").exists():
        directory.mkdir(parents=True, exist_ok=True)
        writer = BinaryWriter(str(directory), chunk_size=2048)
        for i in range(items):
            writer[i] = torch.tensor([i], dtype=torch.int32)
        writer.done()
        writer.merge()
    return str(directory)


def replica(data: str, replicas: int, workers: int, state: dict | None = None) -> object:
    from litdata import StreamingDataLoader, StreamingDataset

    loader = StreamingDataLoader(StreamingDataset(data, shuffle=True, seed=1), batch_size=64, num_workers=workers)
    share = stream_dataloader(loader, dp_rank=0, dp_size=replicas, divisor=replicas, progress=lambda: 1)
    if state is not None:
        share.load_state_dict(state)
    return share


def first_batch_seconds(share: object) -> float:
    start = time.perf_counter()
    next(iter(share))  # type: ignore[call-overload]
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", type=int, default=200_000)
    p.add_argument("--workers", default="0,2", help="DataLoader worker counts to time, comma-separated")
    p.add_argument("--root", default="runs/litdata_resume")
    args = p.parse_args()
    data = write(Path(args.root) / f"items-{args.items}", args.items)
    for workers in (int(w) for w in args.workers.split(",")):
        first = replica(data, 2, workers)
        native = first_batch_seconds(first)
        state = first.state_dict()  # type: ignore[attr-defined]
        elastic = first_batch_seconds(replica(data, 1, workers, state))
        print(
            f"{args.items} items, num_workers={workers}: first batch {native:.2f}s in LitData's order (D2), "
            f"{elastic:.2f}s after a resume onto D1 (elastic path: {1e6 * elastic / args.items:.1f} us per item)"
        )


if __name__ == "__main__":
    main()
