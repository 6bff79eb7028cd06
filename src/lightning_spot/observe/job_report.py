"""A fault-tolerant job's report (``fault_tolerance="torchft"``: each pipeline keeps its history in
``<run>/pipeline-<id>``): each pipeline's summary and the job's GPU-time efficiency.

    job = build_job_report(Storage("s3://bucket/runs/gpt"))   # the run directory itself
    print(format_job_report(job))

GPU-time efficiency here: the samples the job trained / what the GPU-seconds its pipelines' processes held would
train at the per-GPU speed of the fullest quorum (the steps a pipeline's history saw while the most pipelines were
in it). A history sees only GPUs that run a process: a broken pipeline's nodes waiting in their rendezvous are not
charged here (``benchmarks/spot_replay.py`` and the simulator charge every node the trace gives).
"""

from __future__ import annotations

from typing import Any

from lightning_spot.checkpoint.durable.storage import Storage
from lightning_spot.observe.cost import gpu_seconds_by_layout, samples_trained, world_of
from lightning_spot.observe.run_report import build_report, pipeline_histories


def build_job_report(storage: Storage) -> dict[str, Any]:
    """The job's report from the pipelines' histories under ``storage`` (a fault-tolerant run directory)."""
    names = pipeline_histories(storage)
    if not names:
        raise FileNotFoundError(
            f"No pipeline histories under {storage.url} (expected {storage.url_of('pipeline-<id>')}/): a "
            f"fault-tolerant run's SpotCheckpoint dirpath holds one per pipeline."
        )
    reports = {name: build_report(Storage(storage.url_of(name), storage.options)) for name in names}
    held = sum(sum(gpu_seconds_by_layout(r["attempts"]).values()) for r in reports.values())
    samples = max((samples_trained(r["attempts"]) or 0 for r in reports.values()), default=0)
    full = full_quorum_speed(reports)
    per_gpu = full["samples_per_gpu_second"] if full else None
    return {
        "run": storage.url,
        "pipelines": {
            name: {
                "attempts": len(r["attempts"]),
                "last_step": r["attempts"][-1]["last_step"],
                "layout": r["attempts"][-1]["layout"],
                "restarts": len(r["restarts"]),
                "useful_time_share": r["useful_time_share"],
                "fault_tolerance": r["fault_tolerance"],
            }
            for name, r in reports.items()
        },
        "samples": samples,
        "gpu_seconds": held,
        "full_quorum": full,
        "gpu_time_efficiency": samples / (held * per_gpu) if samples and held > 0 and per_gpu else None,
        "committed_checkpoints": storage.committed(),
    }


def full_quorum_speed(reports: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Samples per GPU-second while the most pipelines trained together, from the history that saw that longest:
    its progress marks between which its quorum held the most pipelines (one pipeline alone when none changed)."""
    most = max(_widest(r) for r in reports.values())
    best: dict[str, Any] | None = None
    for name, r in reports.items():
        steps = seconds = 0.0
        batch = depth = None
        for a in r["attempts"]:
            for (t0, s0), (t1, s1) in zip(a["points"], a["points"][1:]):
                if _pipelines_at(r, t0) == most == _pipelines_at(r, t1) and s1 > s0 and t1 > t0:
                    steps, seconds = steps + s1 - s0, seconds + t1 - t0
                    batch, depth = a["global_batch"] or batch, world_of(a)
        if seconds > 0 and batch and depth and (best is None or seconds > best["seconds"]):
            best = {
                "pipeline": name,
                "pipelines": most,
                "depth": depth,
                "seconds": seconds,
                "samples_per_second": steps * batch / seconds,
                "samples_per_gpu_second": steps * batch / seconds / (most * depth),
            }
    return best


def _widest(report: dict[str, Any]) -> int:
    ft = report.get("fault_tolerance")
    return max((n for _, n in ft["pipelines_over_time"]), default=1) if ft else 1  # (no change seen: alone)


def _pipelines_at(report: dict[str, Any], t: float) -> int:
    """Pipelines in this history's quorum at ``t`` (seconds since its start; one when it saw no change)."""
    ft = report.get("fault_tolerance")
    if not ft or not ft["pipelines_over_time"]:
        return 1
    count = ft["pipelines_over_time"][0][1]
    for at, n in ft["pipelines_over_time"]:
        if at <= t:
            count = n
    return int(count)


def format_job_report(job: dict[str, Any]) -> str:
    """``lightning-spot report <run>`` for a fault-tolerant run directory."""
    lines = [f"run          {job['run']} (fault_tolerance='torchft': {len(job['pipelines'])} pipeline histories)"]
    for name, p in job["pipelines"].items():
        ft = p["fault_tolerance"] or {}
        share = p["useful_time_share"]
        lines.append(
            f"  {name:<12} {p['layout']:<24} to step {p['last_step']}, {p['attempts']} attempt(s), "
            f"{ft.get('quorum_changes', 0)} quorum changes, {ft.get('steps_run_again', 0)} steps run again, useful "
            f"time {'-' if share is None else f'{100 * share:.1f}%'}"
        )
    full, eff = job["full_quorum"], job["gpu_time_efficiency"]
    if eff is not None:
        lines.append(
            f"GPU time     {100 * eff:.1f}% efficiency: {job['samples']:,} samples / {job['gpu_seconds']:.1f} "
            f"GPU-seconds held by the pipelines' processes at {full['samples_per_gpu_second']:.2f} samples per "
            f"GPU-second ({full['pipelines']} pipelines of {full['depth']} in the quorum; nodes waiting outside a "
            f"process are not charged)"
        )
    else:
        lines.append("GPU time     - (no steps seen with the fullest quorum)")
    lines.append(f"checkpoints  committed now: {', '.join(job['committed_checkpoints']) or 'none'}")
    lines.append(f"each pipeline: lightning-spot report {job['run'].rstrip('/')}/{next(iter(job['pipelines']))}")
    return "\n".join(lines)
