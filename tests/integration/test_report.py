"""``lightning-spot report``: a run's history as text, JSON and a PNG timeline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.run_history import write_history


@pytest.mark.slow
def test_report_cli_text_json_and_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    write_history(tmp_path / "run")
    png = tmp_path / "run.png"
    exe = str(Path(sys.executable).parent / "lightning-spot")
    out = subprocess.run(
        [exe, "report", str(tmp_path / "run"), "--png", str(png)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "preempted (SIGTERM)" in out.stdout and "timeline written to" in out.stdout
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 10_000
    as_json = subprocess.run(
        [exe, "report", str(tmp_path / "run"), "--json"], capture_output=True, text=True, timeout=120
    )
    assert json.loads(as_json.stdout)["preemptions_survived"] == 1


def test_report_on_a_directory_without_history_names_the_fix(tmp_path: Path) -> None:
    exe = str(Path(sys.executable).parent / "lightning-spot")
    out = subprocess.run([exe, "report", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "No run history" in out.stderr and "SpotCheckpoint" in out.stderr


def test_timeline_merge_without_rank_files_names_the_fix(tmp_path: Path) -> None:
    exe = str(Path(sys.executable).parent / "lightning-spot")
    out = subprocess.run([exe, "timeline", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "no rank<N>.trace.json" in out.stderr and "PipelineTimeline" in out.stderr


@pytest.mark.slow
def test_report_cli_prints_the_cost_section(tmp_path: Path) -> None:
    write_history(tmp_path)
    cli = [sys.executable, "-m", "lightning_spot.cli", "report", str(tmp_path)]
    out = subprocess.run([*cli, "--spot-price", "1.5", "--on-demand-price", "4.1"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "$1.50 (spot) / $4.10 (on demand) per GPU-hour" in out.stdout and "GPU-hours" in out.stdout
    plain = subprocess.run(cli, capture_output=True, text=True)
    assert "per GPU-hour" not in plain.stdout  # no prices given: no cost section
    data = json.loads(subprocess.run([*cli, "--json", "--cost"], capture_output=True, text=True).stdout)
    assert data["cost"]["prices"]["on_demand_per_gpu_hour"] == pytest.approx(32.7726 / 8)
