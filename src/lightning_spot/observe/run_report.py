"""A run's story from its history (``<run>/events/``, written by ``SpotCheckpoint``): layouts over
time, preemptions and restarts, time lost, the useful-time share, checkpoint stall and throughput per layout.

    report = build_report(Storage("s3://bucket/runs/gpt"))
    print(format_report(report))
    Path("run.png").write_bytes(render_run_timeline(report))
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from lightning_spot.checkpoint.durable.journal import (
    EVENTS,
    PIPELINE_HISTORY,
    RECOVERY_PHASES,
    read_events,
    split_attempts,
    summarize,
)
from lightning_spot.checkpoint.durable.storage import Storage
from lightning_spot.layout import layout_label
from lightning_spot.observe.cost import gpu_time_efficiency, useful_seconds

#: events that say "this step was reached at this time" (checkpoint events carry the commit time instead)
PROGRESS_KINDS = ("first_step", "progress", "preempted", "end")


def _attempt_summary(index: int, events: list[dict[str, Any]], t0: float) -> dict[str, Any]:
    start = events[0]
    marks = [e for e in events if e["kind"] in PROGRESS_KINDS and e.get("step") is not None]
    batches = [e["global_batch"] for e in marks if e.get("global_batch")]
    first = next((e for e in marks if e["kind"] == "first_step"), None)
    last = marks[-1] if marks else None
    steps_per_s = samples_per_s = None
    if first is not None and last is not None and last["time"] > first["time"] and last["step"] > first["step"]:
        steps_per_s = (last["step"] - first["step"]) / (last["time"] - first["time"])
        samples_per_s = steps_per_s * batches[-1] if batches else None
    preempted = next((e for e in events if e["kind"] == "preempted"), None)
    if preempted is not None:
        ended = f"preempted ({preempted.get('source', '?')}); checkpoint saved in {preempted.get('save_seconds', '?')}s"
    elif any(e["kind"] == "end" for e in events):
        ended = "finished"
    else:
        ended = "stopped without a notice (killed or failed)"
    saves = [e for e in events if e["kind"] == "checkpoint"]
    return {
        "attempt": index,
        "started": start["time"] - t0,
        "process_started": start["process_started"] - t0 if start.get("process_started") else None,
        "layout": layout_label(start.get("layout")),
        "layout_detail": start.get("layout"),
        "resumed_from_step": start.get("resumed_step"),
        "first_step_after_seconds": round(first["time"] - start["time"], 3) if first else None,
        "last_step": last["step"] if last else start.get("step"),
        "ended": ended,
        "seconds": round(max(e["time"] for e in events) - start["time"], 3),
        "steps_per_second": steps_per_s,
        "samples_per_second": samples_per_s,
        "global_batch": batches[-1] if batches else None,
        "checkpoints": len(saves),
        "checkpoint_stall_seconds": round(sum(e.get("stall_seconds", 0.0) for e in saves), 4),
        "points": [(e["time"] - t0, e["step"]) for e in marks],
        "checkpoint_points": [(e["time"] - t0, e.get("step")) for e in saves],
        "preempted_at": (preempted["time"] - t0, preempted.get("step")) if preempted else None,
    }


def pipeline_histories(storage: Storage) -> list[str]:
    """The per-pipeline history folders (``pipeline-<id>``) of a fault-tolerant run directory."""
    try:
        names = [e.rstrip("/").rsplit("/", 1)[-1] for e in storage.fs.ls(storage.root, detail=False)]
    except FileNotFoundError:
        return []
    return sorted(
        n for n in names if n.startswith(PIPELINE_HISTORY) and _has_events(Storage(storage.url_of(n), storage.options))
    )


def _has_events(storage: Storage) -> bool:
    """Whether a history folder holds any event (listed, not read)."""
    try:
        return any(name.endswith(".json") for name in storage.sizes(EVENTS))
    except FileNotFoundError:
        return False


def _run_of(storage: Storage) -> Storage:
    """Where the checkpoints are: the run directory, also for one pipeline's history inside it."""
    parent = storage.url.rstrip("/").rpartition("/")[0]
    return Storage(parent, storage.options) if _is_pipeline_history(storage.url) and parent else storage


def build_report(storage: Storage) -> dict[str, Any]:
    """Everything ``lightning-spot report`` shows, as a JSON-able dict."""
    events = read_events(storage)
    pipelines = [] if events else pipeline_histories(storage)
    if pipelines:
        raise FileNotFoundError(
            f"{storage.url} is a fault-tolerant run (fault_tolerance='torchft'): each pipeline keeps its own history "
            f"({', '.join(pipelines)}). Report one of them: lightning-spot report {storage.url_of(pipelines[0])}"
        )
    if not events:
        raise FileNotFoundError(
            f"No run history under {storage.url} (expected {storage.url_of('events')}/). The report reads what "
            f"SpotCheckpoint records during fit: point it at a SpotCheckpoint dirpath."
        )
    t0 = events[0]["time"]
    attempts = [_attempt_summary(i, a, t0) for i, a in enumerate(split_attempts(events))]
    totals = summarize(events)
    per_layout: dict[str, list[float]] = {}
    for a in attempts:
        if a["samples_per_second"] is not None:
            per_layout.setdefault(a["layout"], []).append(a["samples_per_second"])
    trained = sum(a["seconds"] for a in attempts)
    wall = events[-1]["time"] - t0
    return {
        "run": storage.url,
        "started": datetime.fromtimestamp(t0, tz=timezone.utc).isoformat(timespec="seconds"),
        "started_epoch": t0,
        "wall_seconds": round(wall, 3),
        "useful_time_share": useful_seconds(attempts) / wall if wall > 0 else None,
        #: samples trained / what the GPUs held would train at the most GPUs' measured speed (torchft: see below)
        "gpu_time_efficiency": None if _is_pipeline_history(storage.url) else gpu_time_efficiency(attempts),
        "attempts": attempts,
        "restarts": totals["restarts"],
        "recovery_phase_seconds": phase_totals(totals["restarts"]),
        "preemptions_survived": totals["preemptions_survived"],
        "steps_recomputed": totals["steps_recomputed"],
        "time_lost_seconds": totals["time_lost_seconds"],
        "checkpoints": totals["checkpoints"],
        "checkpoint_stall_seconds": totals["checkpoint_stall_seconds"],
        "checkpoint_stall_fraction": totals["checkpoint_stall_seconds"] / trained if trained > 0 else 0.0,
        "samples_per_second_by_layout": {k: sum(v) / len(v) for k, v in per_layout.items()},
        "committed_checkpoints": _run_of(storage).committed(),
        #: the intervals SpotCheckpoint chose (the newest choice; none when they were all given)
        "intervals": next((e for e in reversed(events) if e["kind"] == "cadence"), None),
        "fault_tolerance": _quorums(events, t0),
    }


def _is_pipeline_history(url: str) -> bool:
    """Whether ``url`` is one torchft pipeline's history (``<run>/pipeline-<id>``): its steps are the quorum's
    samples, not its own GPUs'."""
    return url.rstrip("/").rsplit("/", 1)[-1].startswith(PIPELINE_HISTORY)


def _quorums(events: list[dict[str, Any]], t0: float) -> dict[str, Any] | None:
    """With ``fault_tolerance="torchft"`` (a pipeline's history): the quorum changes it saw, the steps it ran again
    because a pipeline left during them, the time it trained with fewer pipelines than the most it saw, and the
    pipelines in its quorum over time (``[seconds since the history's start, pipelines]``, from the first change's
    count before it)."""
    changes = [e for e in events if e["kind"] == "quorum"]
    again = [e for e in events if e["kind"] == "step_run_again"]
    if not changes and not again:
        return None
    widths = [e["was"] for e in changes[:1]] + [e["pipelines"] for e in changes]
    most = max(widths, default=None)  # (steps run again without a change seen: the counts are not known)
    reduced, since = 0.0, None
    for e in changes:
        if most is not None and e["pipelines"] < most and since is None:
            since = e["time"]
        elif most is not None and e["pipelines"] >= most and since is not None:
            reduced, since = reduced + e["time"] - since, None
    if since is not None:
        reduced += events[-1]["time"] - since
    return {
        "quorum_changes": len(changes),
        "fewest_pipelines": min(widths, default=None),
        "most_pipelines": most,
        "steps_run_again": len(again),
        "seconds_with_fewer_pipelines": round(reduced, 3),
        "quorum_seconds_max": max((e.get("quorum_seconds", 0.0) for e in changes), default=0.0),
        "pipelines_over_time": ([[0.0, widths[0]]] if widths else [])
        + [[round(e["time"] - t0, 3), e["pipelines"]] for e in changes],
    }


def format_report(report: dict[str, Any]) -> str:
    def num(value: float | None, fmt: str = ".1f") -> str:
        return "-" if value is None else format(value, fmt)

    lines = [
        f"run          {report['run']}",
        f"started      {report['started']}, {report['wall_seconds']:.1f}s of history",
        f"attempts     {len(report['attempts'])}; preemptions survived {report['preemptions_survived']}; "
        f"steps recomputed {report['steps_recomputed']}; time lost to restarts {report['time_lost_seconds']:.1f}s",
        f"useful time  {_share(report.get('useful_time_share'))} of wall time went to steps that were kept",
        _efficiency_line(report),
        f"checkpoints  {report['checkpoints']} saved, training stalled {report['checkpoint_stall_seconds']:.2f}s "
        f"({100 * report['checkpoint_stall_fraction']:.2f}% of training time); committed now: "
        f"{', '.join(report['committed_checkpoints']) or 'none'}",
        *_intervals(report.get("intervals")),
        *_fault_tolerance(report.get("fault_tolerance")),
        "",
        "  #  at (s)  layout                      from step  to step  samples/s   steps/s  ended",
    ]
    for a in report["attempts"]:
        lines.append(
            f"{a['attempt']:>3}  {a['started']:6.1f}  {a['layout']:<28}{num(a['resumed_from_step'], 'd') if a['resumed_from_step'] is not None else '0':>9}"
            f"  {a['last_step'] if a['last_step'] is not None else '-':>7}  {num(a['samples_per_second']):>9}  "
            f"{num(a['steps_per_second'], '.2f'):>8}  {a['ended']}"
        )
    if report["restarts"]:
        lines += ["", "restarts"]
        for r in report["restarts"]:
            lines.append(
                f"  {r['cause']}: stopped at step {r['stopped_at_step']}, resumed from {r['resumed_from_step']}"
                f"{_tier(r)} ({r['steps_recomputed']} steps recomputed), {r['time_lost_seconds']:.1f}s lost, "
                f"{layout_label(r['layout_before'])} -> {layout_label(r['layout_after'])}"
            )
            if r.get("phases"):
                lines.append(f"    {_phases(r['phases'])}")
        lines.append(f"  all restarts: {_phases(report['recovery_phase_seconds'])}")
    if report["samples_per_second_by_layout"]:
        lines += ["", "throughput per layout"]
        lines += [f"  {k:<28}{v:10.1f} samples/s" for k, v in report["samples_per_second_by_layout"].items()]
    return "\n".join(lines)


def _efficiency_line(report: dict[str, Any]) -> str:
    """GPU-time efficiency, or why a history cannot tell it."""
    value = report.get("gpu_time_efficiency")
    if value is not None:
        return (
            f"GPU time     {_share(value)} efficiency: samples trained / what the GPU-seconds held would train at "
            f"the largest layout's measured speed"
        )
    if _is_pipeline_history(report["run"]):
        return "GPU time     - (one torchft pipeline's history: its steps are the quorum's; spot_replay.py measures the job's)"
    return "GPU time     - (no speed measured on the largest layout)"


def _fault_tolerance(ft: dict[str, Any] | None) -> list[str]:
    if not ft:
        return []
    counts = f" ({ft['fewest_pipelines']}-{ft['most_pipelines']} pipelines)" if ft["most_pipelines"] else ""
    return [
        f"torchft      {ft['quorum_changes']} quorum changes{counts}, "
        f"{ft['steps_run_again']} steps run again, {ft['seconds_with_fewer_pipelines']:.1f}s with fewer pipelines"
    ]


def _intervals(chosen: dict[str, Any] | None) -> list[str]:
    """The line of the chosen checkpoint intervals (none if every interval was given)."""
    if not chosen:
        return []
    parts = []
    if chosen.get("snapshot_seconds"):
        parts.append(f"snapshots every {chosen['snapshot_seconds']:.1f}s")
    if chosen.get("durable_seconds"):
        parts.append(
            f"durable every {chosen['durable_seconds']:.0f}s (Young-Daly: cost {chosen['durable_cost_seconds']:.3f}s, "
            f"mean time between interruptions {chosen['mtbf_seconds'] / 3600:.2f} h from "
            f"{chosen['interruptions']} interruption(s) and the prior)"
        )
    return [f"intervals    chosen at step {chosen.get('step')}: {'; '.join(parts)}"] if parts else []


def phase_totals(restarts: list[dict[str, Any]]) -> dict[str, float | None]:
    """Seconds per recovery phase (``journal.recovery_phases``) over all restarts; ``None`` where none told."""
    out: dict[str, float | None] = {}
    for name in RECOVERY_PHASES:
        known = [r["phases"][name] for r in restarts if r.get("phases", {}).get(name) is not None]
        out[name] = round(sum(known), 3) if known else None
    return out


def _phases(phases: dict[str, float | None]) -> str:
    """``stop 2.1s, restart 5.3s, ...`` (``-`` where unknown)."""
    return ", ".join(
        f"{name.replace('_', ' ')} {'-' if phases.get(name) is None else format(phases[name], '.1f') + 's'}"
        for name in RECOVERY_PHASES
    )


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _tier(restart: dict[str, Any]) -> str:
    """Where a resume read its state (memory or storage) and how long that took, for the restart line."""
    tier, took = restart.get("resumed_from"), restart.get("restore_seconds")
    if not tier:
        return ""
    return f" (from {tier}{f', read in {took:.1f}s' if took is not None else ''})"


def render_run_timeline(report: dict[str, Any], width: float = 11.0) -> bytes:
    """Training step over wall-clock time, one colour per layout; checkpoints, preemptions and restarts marked."""
    from lightning_spot.observe.gantt import import_pyplot, png_bytes

    plt = import_pyplot()
    fig, ax = plt.subplots(figsize=(width, 4.2))
    layouts = list(dict.fromkeys(a["layout"] for a in report["attempts"]))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    labelled: set[str] = set()

    def once(label: str) -> str | None:
        """The legend label the first time, none after (one legend entry per kind)."""
        if label in labelled:
            return None
        labelled.add(label)
        return label

    for a, b in zip(report["attempts"], report["attempts"][1:]):
        end = max([t for t, _ in a["points"]] + [a["started"]])
        ax.axvspan(
            end,
            b["started"] + (b["first_step_after_seconds"] or 0.0),
            color="#DDDDDD",
            zorder=0,
            label=once("restart (time lost)"),
        )
    for a in report["attempts"]:
        colour = colours[layouts.index(a["layout"]) % len(colours)]
        if a["points"]:
            xs, ys = zip(*a["points"])
            ax.plot(xs, ys, "-o", color=colour, markersize=2.5, label=once(a["layout"]))
        if a["checkpoint_points"]:
            xs, ys = zip(*a["checkpoint_points"])
            ax.plot(
                xs, ys, linestyle="none", marker="|", color="#555555", markersize=9, label=once("checkpoint committed")
            )
        if a["preempted_at"]:
            ax.plot(
                *a["preempted_at"],
                marker="X",
                color="#D93025",
                markersize=9,
                label=once("preemption (checkpoint, exit)"),
            )
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel("training step")
    ax.set_title(
        f"{report['run']}: {len(report['attempts'])} attempts, {report['preemptions_survived']} preemptions survived, "
        f"{report['time_lost_seconds']:.0f}s lost",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    return png_bytes(fig, 120)
