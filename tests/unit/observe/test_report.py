"""The run report from a run's history, in one process: a preempted run's story, restarts, pipelines, useful time and cost."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_spot.checkpoint.durable.journal import EVENTS
from lightning_spot.checkpoint.durable.storage import Storage, step_dirname
from lightning_spot.observe.run_report import build_report, format_report
from tests.run_history import P2D1, write_history


def test_report_tells_the_story_of_a_preempted_run(tmp_path: Path) -> None:
    write_history(tmp_path)
    report = build_report(Storage(str(tmp_path)))
    assert [a["layout"] for a in report["attempts"]] == ["P2xD2 1F1B M=4", "P2xD1 1F1B M=4"]
    assert report["preemptions_survived"] == 1 and report["steps_recomputed"] == 0
    assert report["time_lost_seconds"] == pytest.approx(23.8)  # last sign of life +20.2 (the commit), next step +44
    assert report["checkpoint_stall_seconds"] == pytest.approx(0.2)
    assert report["restarts"][0]["resumed_from"] == "memory" and report["restarts"][0]["restore_seconds"] == 0.25
    phases = report["restarts"][0]["phases"]  # notice +19.1, committed +20, exited +20.2, new processes +30
    assert phases == pytest.approx({"stop": 0.9, "restart": 9.8, "setup": 9.75, "restore": 0.25, "first_step": 4.0})
    assert sum(phases[k] for k in ("restart", "setup", "restore", "first_step")) == pytest.approx(23.8)
    assert report["recovery_phase_seconds"] == pytest.approx(phases)
    first, second = report["attempts"]
    assert first["samples_per_second"] == pytest.approx((30 - 1) / 15 * 32)  # first step -> the preemption
    assert second["samples_per_second"] == pytest.approx((50 - 31) / 14 * 32)
    assert first["ended"].startswith("preempted (SIGTERM)") and second["ended"] == "finished"
    text = format_report(report)
    for needle in (
        "preemptions survived 1",
        "time lost to restarts 23.8s",
        "P2xD2 1F1B M=4 -> P2xD1 1F1B M=4",
        "resumed from 30 (from memory, read in 0.2s)",
        "throughput per layout",
        "stalled 0.20s",
        "stop 0.9s, restart 9.8s, setup 9.8s, restore 0.2s, first step 4.0s",
    ):
        assert needle in text, text


def test_a_run_continued_after_it_finished_is_not_a_restart(tmp_path: Path) -> None:
    """The same command again with a larger max_steps: a new attempt, neither a failure nor a preemption."""
    write_history(tmp_path)
    t = 1_700_000_100.0
    storage = Storage(str(tmp_path))
    for i, e in enumerate(
        [
            {"kind": "start", "time": t, "step": 50, "resumed_step": 50, "layout": P2D1, "process_started": t - 5},
            {"kind": "first_step", "time": t + 2, "step": 51, "global_batch": 32},
            {"kind": "end", "time": t + 9, "step": 60},
        ]
    ):
        storage.write_json(f"{EVENTS}/{100 + i:020d}-{e['kind']}.json", e)
    report = build_report(storage)
    assert len(report["attempts"]) == 3 and report["preemptions_survived"] == 1
    assert report["time_lost_seconds"] == pytest.approx(23.8), "the pause between the two runs is not lost time"


def test_a_fault_tolerant_run_is_reported_per_pipeline_with_the_run_s_checkpoints(tmp_path: Path) -> None:
    """fault_tolerance="torchft": each pipeline's history is in <run>/pipeline-<id>; the run directory itself
    names them, and a pipeline's report lists the checkpoints of the run directory (where they are)."""
    write_history(tmp_path / "pipeline-0")
    write_history(tmp_path / "pipeline-3")
    (tmp_path / "pipeline-9").mkdir()  # (no history: not named)
    (tmp_path / step_dirname(50)).mkdir()
    (tmp_path / step_dirname(50) / "manifest.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"fault-tolerant run.*\(pipeline-0, pipeline-3\).*report .*pipeline-0"):
        build_report(Storage(str(tmp_path)))
    report = build_report(Storage(str(tmp_path / "pipeline-0")))
    assert report["committed_checkpoints"] == [step_dirname(50)] and report["attempts"][-1]["last_step"] == 50
    # (a pipeline's steps are the quorum's samples: no efficiency against its own GPUs)
    assert report["gpu_time_efficiency"] is None and "one torchft pipeline's history" in format_report(report)


def test_report_counts_useful_time_and_cost(tmp_path: Path) -> None:
    """Useful time: steps 0-30 at P2xD2's pace and 30-50 at P2xD1's, over 58 s of wall time. GPU-hours: 4 processes
    for 20.2 s, then 2 from the end of the first attempt to the end (37.8 s). On demand without preemptions:
    1600 samples at P2xD2's measured 61.9 samples/s on 4 GPUs."""
    from lightning_spot.observe.cost import Prices, format_cost, run_cost

    write_history(tmp_path)
    report = build_report(Storage(str(tmp_path)))
    useful = 30 / ((30 - 1) / 15) + 20 / ((50 - 31) / 14)
    assert report["useful_time_share"] == pytest.approx(useful / 58)
    assert "useful time" in format_report(report)
    # GPU time: 1600 samples against 20.2 s x 4 + 37.8 s x 2 GPU-seconds at P2xD2's 61.9 samples/s over 4 GPUs
    per_gpu = (30 - 1) / 15 * 32 / 4
    assert report["gpu_time_efficiency"] == pytest.approx(1600 / ((20.2 * 4 + 37.8 * 2) * per_gpu))
    assert f"{100 * report['gpu_time_efficiency']:.1f}% efficiency" in format_report(report)
    cost = run_cost(report, Prices(spot_per_gpu_hour=1.0, on_demand_per_gpu_hour=4.0))
    assert cost["gpu_hours_by_layout"] == pytest.approx(
        {"P2xD2 1F1B M=4": 20.2 * 4 / 3600, "P2xD1 1F1B M=4": 37.8 * 2 / 3600}
    )
    assert cost["spot_dollars"] == pytest.approx((20.2 * 4 + 37.8 * 2) / 3600)
    assert cost["trained"] == {"unit": "samples", "count": 1600}
    assert cost["dollars_per_million"] == pytest.approx(cost["spot_dollars"] / 0.0016)
    od = cost["on_demand_without_preemptions"]
    assert od["layout"] == "P2xD2 1F1B M=4"
    assert od["gpu_hours"] == pytest.approx(1600 / ((30 - 1) / 15 * 32) * 4 / 3600)
    assert od["dollars"] == pytest.approx(od["gpu_hours"] * 4.0)
    tokens = run_cost(report, Prices(spot_per_gpu_hour=1.0, on_demand_per_gpu_hour=4.0, tokens_per_sample=128))
    assert tokens["trained"] == {"unit": "tokens", "count": 1600 * 128}
    text = format_cost(cost)
    assert "per 1M samples" in text and "spot saved" in text


def _pipeline_history(storage: Storage, t: float, events: list[dict]) -> None:
    for i, e in enumerate(events):
        storage.write_json(f"{EVENTS}/{i:020d}-{e['kind']}.json", {**e, "time": t + e["time"]})


def test_a_fault_tolerant_job_s_report_charges_every_pipeline_s_gpu_seconds(tmp_path: Path) -> None:
    """Two one-stage pipelines of batches of 8: pipeline 0 trains steps 0-40 over 40 s, with pipeline 1 in its
    quorum from 0 to 20 s (2 steps/s then, 16 samples/s on 2 GPUs: 8 per GPU-second), alone after (its pace drops);
    pipeline 1 holds its GPU 19.9 s. 40 steps x 8 samples against 59.9 GPU-seconds at 8 samples per GPU-second."""
    from lightning_spot.cli.report import main as report_main
    from lightning_spot.observe.job_report import build_job_report, format_job_report

    layout = {"pipeline_stages": 1, "data_parallel": 1, "world_size": 1}
    t = 1_700_000_000.0
    points = [{"kind": "progress", "time": float(s), "step": 2 * s, "global_batch": 8} for s in range(1, 11)]
    points += [
        {"kind": "progress", "time": float(s), "step": 20 + (s - 10) * 2 // 3, "global_batch": 8} for s in (25, 40)
    ]
    _pipeline_history(
        Storage(str(tmp_path / "pipeline-0")),
        t,
        [
            {"kind": "start", "time": 0.0, "step": 0, "layout": layout},
            {"kind": "first_step", "time": 0.5, "step": 1, "global_batch": 8},
            *points[:10],
            {"kind": "quorum", "time": 20.0, "step": 20, "pipelines": 1, "was": 2},
            *points[10:],
            {"kind": "end", "time": 40.0, "step": 40},
        ],
    )
    _pipeline_history(
        Storage(str(tmp_path / "pipeline-1")),
        t,
        [
            {"kind": "start", "time": 0.0, "step": 0, "layout": layout},
            {"kind": "first_step", "time": 0.5, "step": 1, "global_batch": 8},
            {"kind": "progress", "time": 19.9, "step": 19, "global_batch": 8},
        ],
    )
    job = build_job_report(Storage(str(tmp_path)))
    assert job["gpu_seconds"] == pytest.approx(40 + 19.9)
    assert job["full_quorum"]["pipelines"] == 2 and job["full_quorum"]["samples_per_gpu_second"] == pytest.approx(8.0)
    assert job["samples"] == 40 * 8
    assert job["gpu_time_efficiency"] == pytest.approx(320 / (59.9 * 8.0))
    assert "GPU time     66.8% efficiency" in format_job_report(job) and "pipeline-1" in format_job_report(job)
    assert report_main([str(tmp_path)]) == 0 and report_main([str(tmp_path), "--png", str(tmp_path / "x.png")]) == 1
