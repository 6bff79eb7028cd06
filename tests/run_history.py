"""A run's history as a journal and checkpoints, written by hand: what the run report reads (tests of ``observe``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_spot.checkpoint.durable.journal import EVENTS
from lightning_spot.checkpoint.durable.storage import Storage

P2D2 = {"pipeline_stages": 2, "data_parallel": 2, "schedule": "1F1B", "microbatches": 4, "cuts": [2], "stages": 2}
P2D1 = {**P2D2, "data_parallel": 1}


def write_history(root: Path) -> None:
    """Two attempts: P2xD2 preempted at step 30 (checkpoint 30), then P2xD1 from 30 to 50."""
    t = 1_700_000_000.0
    events: list[dict[str, Any]] = [
        {"kind": "start", "time": t, "step": 0, "resumed_step": None, "layout": P2D2, "restart_count": 0},
        {"kind": "first_step", "time": t + 5, "step": 1, "global_batch": 32},
        {"kind": "progress", "time": t + 15, "step": 21, "global_batch": 32},
        {"kind": "checkpoint", "time": t + 16, "step": 20, "stall_seconds": 0.05, "write_seconds": 1.0, "bytes": 10},
        {
            "kind": "preempted",
            "time": t + 20,
            "step": 30,
            "source": "SIGTERM",
            "save_seconds": 0.4,
            "rank": 1,
            "notice_time": t + 19.1,
        },
        {"kind": "checkpoint", "time": t + 20.2, "step": 30, "stall_seconds": 0.1, "write_seconds": 0.3, "bytes": 10},
        {
            "kind": "start",
            "time": t + 40,
            "step": 30,
            "resumed_step": 30,
            "resumed_from": "memory",
            "restore_seconds": 0.25,
            "layout": P2D1,
            "restart_count": 1,
            "process_started": t + 30,
        },
        {"kind": "first_step", "time": t + 44, "step": 31, "global_batch": 32},
        {"kind": "progress", "time": t + 54, "step": 46, "global_batch": 32},
        {"kind": "checkpoint", "time": t + 58, "step": 50, "stall_seconds": 0.05, "write_seconds": 0.5, "bytes": 10},
        {"kind": "end", "time": t + 58, "step": 50},
    ]
    storage = Storage(str(root))
    for i, e in enumerate(events):
        storage.write_json(f"{EVENTS}/{i:020d}-{e['kind']}.json", e)
