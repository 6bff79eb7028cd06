"""Every way in gives each rank the same CPU thread setup, a user's choice wins, and logs stay true.

Each job is started as a user starts it, without thread settings in the environment: a script with
Lightning's launcher, ``lightning-spot fit`` (LightningCLI), and ``lightning-spot run`` (torchrun).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lightning_spot.runtime.host_malloc import is_glibc
from lightning_spot.runtime.process import suggested_threads
from tests.distributed import run_command

WORKER = "tests/workers/report_setup.py"
EXE = str(Path(sys.executable).parent / "lightning-spot")

CLI_CONFIG = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 2
  max_steps: 3
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  default_root_dir: {root}
  strategy:
    class_path: lightning_spot.SpotPipelineStrategy
    init_args: {{pipeline_stages: 2, microbatches: 2, schedule: gpipe}}
  callbacks:
    - class_path: tests.models.ReportSetup
      init_args: {{dirpath: {out}}}
{timeline}
model:
  class_path: tests.models.TinyPipelineModel
data:
  class_path: tests.models.TinyDataModule
"""
TIMELINE = """    - class_path: lightning_spot.PipelineTimeline
      init_args: {{dirpath: {out}/timeline, start_step: 1, num_steps: 1, gantt: false}}"""


@pytest.fixture(autouse=True)
def _no_thread_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment users have: nothing says how many threads to use."""
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)


def _reports(out: Path, world: int = 2) -> list[dict]:
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    assert all(r["local_world_size"] == world for r in reports), reports
    return reports


def _assert_rule(reports: list[dict]) -> None:
    expected = suggested_threads(len(reports))  # this machine's CPUs / 2 processes
    assert [r["threads"] for r in reports] == [expected] * len(reports), reports
    assert {r["source"] for r in reports} == {"rule"}, reports
    assert {r["omp_num_threads"] for r in reports} == {str(expected)}, reports
    assert {r["host_malloc"] for r in reports} == {is_glibc()}, reports  # runtime.host_malloc, on every rank


def test_script_with_lightnings_launcher_and_its_logs(tmp_path: Path) -> None:
    """A script under Lightning's launcher: the thread rule on every rank, said once; and its logs hold no warnings
    that do not apply to the user (those that do are still shown). (With a timeline: ``test_lightning_cli`` and
    ``lightning-spot run`` below.)"""
    out = run_command([sys.executable, WORKER, str(tmp_path)], timeout=180)
    _assert_rule(_reports(tmp_path))
    assert out.count("CPU thread per process") + out.count("CPU threads per process") == 1, "said once, by rank 0"
    # the strategy reduces logged values over replicas itself; Lightning's LeafSpec use is not the user's concern
    assert "sync_dist=True" not in out, out[-3000:]
    assert "LeafSpec" not in out, out[-3000:]
    assert "a genuine warning from the user's training_step" in out, out[-3000:]


def test_lightning_cli(tmp_path: Path) -> None:
    """``lightning-spot fit`` with a PipelineTimeline among the config's callbacks: the rule, and the trace."""
    config = tmp_path / "config.yaml"
    config.write_text(CLI_CONFIG.format(root=tmp_path / "root", out=tmp_path, timeline=TIMELINE.format(out=tmp_path)))
    run_command([EXE, "fit", "--config", str(config)], timeout=180)
    _assert_rule(_reports(tmp_path))
    assert (tmp_path / "timeline" / "trace.json").is_file()


@pytest.mark.slow
def test_torchrun_through_lightning_spot_run(tmp_path: Path) -> None:
    """torchrun sets OMP_NUM_THREADS=1 for its workers by default; that is torchrun's choice, not the user's."""
    run_command([EXE, "run", "--nproc-per-node", "2", WORKER, str(tmp_path)], timeout=180)
    _assert_rule(_reports(tmp_path))


@pytest.mark.slow
def test_users_environment_wins(tmp_path: Path) -> None:
    run_command(
        [EXE, "run", "--nproc-per-node", "2", WORKER, str(tmp_path), "--timeline"],
        timeout=180,
        env={"OMP_NUM_THREADS": "3"},
    )
    reports = _reports(tmp_path)  # (torch caps the pool at the machine's cores)
    assert {(r["threads"], r["source"], r["omp_num_threads"]) for r in reports} == {
        (reports[0]["threads"], "environment", "3")
    }, reports


@pytest.mark.slow
def test_users_set_num_threads_wins(tmp_path: Path) -> None:
    run_command([sys.executable, WORKER, str(tmp_path), "--set-threads", "3"], timeout=180)
    reports = _reports(tmp_path)  # also in the process Lightning's launcher runs in, which resets the pool
    assert [(r["threads"], r["source"]) for r in reports] == [(3, "user")] * 2, reports
