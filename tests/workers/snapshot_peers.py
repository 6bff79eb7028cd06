"""Two ranks on two "nodes" snapshot with peer copies; rank 0's second snapshot is dropped (a tensor changed
before its background copy). Both ranks must finish (no one waits for a copy that never comes) and each
writes what its store holds: ``python snapshot_peers.py OUT``."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_spot.checkpoint.memory import snapshotter as snapshotter_module
from lightning_spot.checkpoint.memory.snapshot import SnapshotStore
from lightning_spot.checkpoint.memory.snapshotter import Snapshotter


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    store = SnapshotStore(out / f"shm-{rank}")
    store.check()
    taker = Snapshotter(store, None, rank=rank, world=2, local_world=1, stage_of=lambda r: r)
    assert taker.peer_copy
    moments = {"state.w.exp_avg": torch.full((300,), float(rank))}
    for step in (1, 2, 3):
        checkpoint = {"state_dict": {"w": torch.ones(300)}, "optimizer_states": [moments], "global_step": step}
        share = taker.copy(checkpoint, step)
        if rank == 0 and step == 2:  # hold the background thread back, change a tensor, then let it run
            real = snapshotter_module.start_background
            held: list = []
            snapshotter_module.start_background = lambda target, *args, held=held: held.append((target, args))  # type: ignore[assignment]
            taker.take(share, {"step": step, "layout": {}})
            snapshotter_module.start_background = real
            moments["state.w.exp_avg"].add_(1.0)
            taker.thread = threading.Thread(target=held[0][0], args=held[0][1])
            taker.thread.start()
        else:
            taker.take(share, {"step": step, "layout": {}})
        taker.wait()
    held_shares = {str(s): sorted(r) for s, r in store.shares().items()}
    (out / f"rank{rank}.json").write_text(json.dumps({"shares": held_shares, "changed": taker.changed(2)}))
    taker.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(Path(sys.argv[1]))
