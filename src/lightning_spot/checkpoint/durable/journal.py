"""A run's history next to its checkpoints: starts, first steps, progress, saves, preemptions and ends.

    journal = Journal(storage, enabled=trainer.is_global_zero)
    journal.record("start", step=0, layout={...})          # written in the background, one object per event
    summarize(read_events(storage))   # {"preemptions_survived": 2, "steps_recomputed": 7, ...}

Events live under ``<run>/events/`` as small JSON objects named by time, so that object stores
(which cannot append) keep the history too. They feed the end-of-fit report and ``lightning-spot report``.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from lightning_spot.checkpoint.durable.storage import Storage

log = logging.getLogger(__name__)
EVENTS = "events"
#: with fault_tolerance="torchft" each pipeline keeps its history in ``<run>/pipeline-<id>/``
PIPELINE_HISTORY = "pipeline-"
#: a restart's phases, in order (``recovery_phases``)
RECOVERY_PHASES = ("stop", "restart", "setup", "restore", "first_step")


class Journal:
    """Appends events to the run directory (on rank 0), without blocking training."""

    def __init__(self, storage: Storage, enabled: bool) -> None:
        self.storage = storage
        self.enabled = enabled
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="lightning-spot-journal") if enabled else None
        self._pending: list[Future] = []

    def record(self, kind: str, **fields: Any) -> None:
        if self._executor is None:
            return
        now = time.time()
        event = {"kind": kind, "time": now, **fields}
        name = f"{EVENTS}/{time.time_ns():020d}-{kind}.json"
        self._pending = [f for f in self._pending if not f.done()]
        self._pending.append(self._executor.submit(self._write, name, event))

    def _write(self, name: str, event: dict[str, Any]) -> None:
        try:
            self.storage.write_json(name, event)
        except Exception as err:
            log.warning("lightning-spot: could not record %s in the run history: %s", event["kind"], err)

    def flush(self) -> None:
        for future in self._pending:
            future.result()
        self._pending.clear()

    def close(self) -> None:
        self.flush()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def read_events(storage: Storage) -> list[dict[str, Any]]:
    """All recorded events of a run, oldest first."""
    try:
        names = sorted(storage.sizes(EVENTS))
    except FileNotFoundError:
        return []
    events: list[dict[str, Any]] = []
    for name in names:
        if name.endswith(".json"):
            try:
                events.append(storage.read_json(f"{EVENTS}/{name}"))
            except (ValueError, OSError) as err:
                log.warning("lightning-spot: skipping unreadable history event %s: %s", name, err)
    return events


def split_attempts(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """A run's events grouped by attempt: each ``start`` begins a new one."""
    attempts: list[list[dict[str, Any]]] = []
    for event in events:
        if event["kind"] == "start" or not attempts:
            attempts.append([])
        attempts[-1].append(event)
    return attempts


def recovery_phases(
    preempted: dict[str, Any] | None, last_time: float, start: dict[str, Any], first: dict[str, Any] | None
) -> dict[str, float | None]:
    """One restart's time, phase by phase (seconds; ``None`` where the history cannot tell):

    - ``stop``: notice -> checkpoint committed and processes exiting (a coordinated stop; none without notice);
    - ``restart``: the previous attempt's last record -> the new processes exist (exit, failure detection,
      rendezvous, launch; after a kill it also holds the steps taken since the last record);
    - ``setup``: process start -> training starts, less the state read (imports, process groups, planning);
    - ``restore``: the state read (memory or storage);
    - ``first_step``: training starts -> the first step is done.

    ``restart + setup + restore + first_step`` is the restart's ``time_lost_seconds``."""
    notice = preempted.get("notice_time") if preempted else None
    began = start.get("process_started")
    restore = start.get("restore_seconds") or 0.0
    return {
        "stop": round(preempted["time"] - notice, 3) if preempted and notice else None,
        "restart": round(began - last_time, 3) if began else None,
        "setup": round(start["time"] - restore - began, 3) if began else None,
        "restore": start.get("restore_seconds"),
        "first_step": round(first["time"] - start["time"], 3) if first else None,
    }


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Preemptions survived, steps recomputed and time lost per restart, from a run's events."""
    attempts = split_attempts(events)
    restarts = []
    for before, after in zip(attempts, attempts[1:]):
        if any(e["kind"] == "end" for e in before):  # that attempt finished (max_steps): a later run continues it
            continue
        last_step = max((e.get("step", 0) for e in before), default=0)
        last_time = max(e["time"] for e in before)
        start = after[0]
        resumed = start.get("resumed_step") or 0
        first = next((e for e in after if e["kind"] == "first_step"), None)
        preempted = next((e for e in before if e["kind"] == "preempted"), None)
        restarts.append(
            {
                "cause": f"preemption notice ({preempted['source']})" if preempted else "failure (no notice)",
                "phases": recovery_phases(preempted, last_time, start, first),
                "stopped_at_step": last_step,
                "resumed_from_step": resumed,
                "resumed_from": start.get("resumed_from"),  # "memory" (a snapshot) or "storage"
                "restore_seconds": start.get("restore_seconds"),
                "steps_recomputed": max(0, last_step - resumed),
                "time_lost_seconds": round((first["time"] if first else start["time"]) - last_time, 3),
                "layout_before": next((e.get("layout") for e in before if e["kind"] == "start"), None),
                "layout_after": start.get("layout"),
            }
        )
    saves = [e for e in events if e["kind"] == "checkpoint"]
    return {
        "attempts": len(attempts),
        "preemptions_survived": len(restarts),
        "steps_recomputed": sum(r["steps_recomputed"] for r in restarts),
        "time_lost_seconds": round(sum(r["time_lost_seconds"] for r in restarts), 3),
        "restarts": restarts,
        "checkpoints": len(saves),
        "checkpoint_stall_seconds": round(sum(e.get("stall_seconds", 0.0) for e in saves), 4),
    }


#: a gap between two events longer than this is not counted as running time (the job was down)
RUNNING_GAP_SECONDS = 300.0


def interruption_history(storage: Storage) -> tuple[float, int]:
    """(running seconds, interruptions) of the run so far, from the names of its events alone (one listing): an
    interruption is an attempt that ended without an ``end`` event and was followed by another."""
    try:
        names = sorted(n for n in storage.sizes(EVENTS) if n.endswith(".json"))
    except FileNotFoundError:
        return 0.0, 0
    events: list[dict[str, Any]] = []
    for name in names:
        stamp, _, kind = name[: -len(".json")].partition("-")
        if stamp.isdigit():
            events.append({"time": int(stamp) / 1e9, "kind": kind})
    exposure = sum(min(b["time"] - a["time"], RUNNING_GAP_SECONDS) for a, b in zip(events, events[1:]))
    attempts = split_attempts(events)
    interruptions = sum(1 for attempt in attempts[:-1] if all(e["kind"] != "end" for e in attempt))
    return exposure, interruptions
