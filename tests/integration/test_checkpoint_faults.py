"""Faults: damaged or missing checkpoints, a crash in the middle of an upload, flaky and unreachable storage.

Nothing is lost: a damaged latest checkpoint is skipped with a warning naming the problem and the
previous committed one is resumed; a process killed mid-upload leaves the previous checkpoint
loadable; storage that cannot be used fails at setup, before any training step.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from tests.distributed import WorkerFailure, launch
from tests.parity import assert_same_params, merged_state, reference_run, run_scenarios

CASE: dict[str, Any] = {"model": {"scheduler": True}, "loader": {"batch_size": 16, "n": 64}}


P2D1 = {"pipeline_stages": 2, "microbatches": 4}


def _scenario(name: str, dirpath: str, max_steps: int, **spot: Any) -> dict[str, Any]:
    return {
        **CASE,
        "name": name,
        "strategy": P2D1,
        "trainer": {"max_steps": max_steps},
        "spot_checkpoint": {"dirpath": dirpath, "every_n_train_steps": 2, "keep_last": 5, "snapshots": False, **spot},
    }


def _shard(run: Path, step: int) -> Path:
    return sorted((run / f"step-{step:09d}").glob("*.distcp"))[0]


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A run with checkpoints at steps 2 and 4, copied and damaged in several ways, then resumed to step 6."""
    tmp = tmp_path_factory.mktemp("faults")
    base = tmp / "base"
    run_scenarios(2, [_scenario("base", str(base), 4)], tmp / "phase1")
    runs = {}
    for case in ("corrupt", "truncate", "no-manifest", "all-damaged"):
        runs[case] = tmp / case
        shutil.copytree(base, runs[case])
    shard = _shard(runs["corrupt"], 4)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    shard = _shard(runs["truncate"], 4)
    shard.write_bytes(shard.read_bytes()[:-100])
    (runs["no-manifest"] / "step-000000004" / "manifest.json").unlink()
    for step in (2, 4):
        _shard(runs["all-damaged"], step).write_bytes(b"garbage")
    scenarios = [_scenario(case, str(runs[case]), 6) for case in ("corrupt", "truncate", "no-manifest")]
    results = run_scenarios(2, scenarios, tmp / "phase2")
    logs = "\n".join((tmp / "phase2" / "logs" / f"rank{r}.log").read_text() for r in range(2))
    with pytest.raises(WorkerFailure) as failure:
        run_scenarios(2, [_scenario("all-damaged", str(runs["all-damaged"]), 6)], tmp / "phase3")
    return {"results": results, "logs": logs, "all_damaged": str(failure.value), "runs": runs}


@pytest.fixture(scope="module")
def six_steps() -> dict[str, Any]:
    return reference_run({**CASE, "trainer": {"max_steps": 6}})


@pytest.mark.parametrize(
    ("case", "warning"),
    [
        ("corrupt", r"step-000000004 is damaged \(__\d_0\.distcp fails its checksum"),
        ("truncate", r"step-000000004 is damaged \(__\d_0\.distcp has \d+ bytes, expected \d+ \(truncated\?\)"),
        ("no-manifest", None),
    ],
)
@pytest.mark.slow
def test_damaged_latest_checkpoint_falls_back_to_the_previous_one(
    damaged: dict, six_steps: dict, case: str, warning: str | None
) -> None:
    import re

    ranks = damaged["results"][case]
    assert all(r["restored_step"] == 2 for r in ranks)
    assert_same_params(merged_state(ranks), six_steps)
    if warning:
        assert re.search(warning, damaged["logs"]), damaged["logs"][-3000:]


@pytest.mark.slow
def test_no_intact_checkpoint_is_a_clear_error(damaged: dict) -> None:
    message = damaged["all_damaged"]
    assert "No usable checkpoint under" in message
    assert "step-000000004" in message and "step-000000002" in message and "(truncated?)" in message


def test_kill_during_upload_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    """SIGKILL every rank while step 4 is being uploaded; the same command then resumes from step 2."""
    run = tmp_path / "run"
    marker = tmp_path / "uploading"
    spec = tmp_path / "phase1.json"
    spec.write_text(json.dumps([_scenario("crash", f"slowfile://{run}", 6)]))
    launch(
        2,
        ["tests/workers/run_scenarios.py", str(spec), str(tmp_path / "out1")],
        log_dir=tmp_path / "logs1",
        timeout=180,
        env={"SPOT_TEST_SLOW_STEP": "4", "SPOT_TEST_MARKER": str(marker)},
        kill_when=marker.exists,
    )
    assert marker.exists(), "the job was killed while it uploaded step 4"
    step4 = run / "step-000000004"
    assert step4.is_dir() and not (step4 / "manifest.json").exists(), "step 4 was left half-written"
    assert (run / "step-000000002" / "manifest.json").exists()

    resumed = run_scenarios(2, [_scenario("resume", str(run), 6)], tmp_path / "phase2")["resume"]
    assert all(r["restored_step"] == 2 for r in resumed)
    assert_same_params(merged_state(resumed), reference_run({**CASE, "trainer": {"max_steps": 6}}))
    committed = sorted(p.parent.name for p in run.glob("step-*/manifest.json"))
    assert committed == ["step-000000002", "step-000000004", "step-000000006"]
    assert sorted(p.name for p in run.glob("step-*")) == committed, "the half-written step 4 was replaced"


def test_transient_storage_errors_are_retried(tmp_path: Path) -> None:
    """The first write of every file fails with a connection reset; the checkpoints still commit."""
    run = tmp_path / "run"
    results = run_scenarios(
        1, [{**_scenario("flaky", f"flakyfile://{run}", 4), "strategy": {"pipeline_stages": 1}}], tmp_path
    )
    assert results["flaky"][0]["spot"]["saves"][-1]["step"] == 4
    assert sorted(p.parent.name for p in run.glob("step-*/manifest.json")) == ["step-000000002", "step-000000004"]
    log = (tmp_path / "logs" / "rank0.log").read_text()
    assert "flaky network while writing" in log and "retrying" in log


def test_unusable_storage_fails_before_training(tmp_path: Path, s3_endpoint: str) -> None:
    from tests.distributed import free_port

    cases = {
        "unreachable": (
            "s3://bucket/run",
            {"endpoint_url": f"http://127.0.0.1:{free_port()}", "key": "k", "secret": "s"},
        ),
        "no-bucket": ("s3://no-such-bucket-here/run", {"endpoint_url": s3_endpoint, "key": "k", "secret": "s"}),
    }
    expected = {
        "unreachable": "Cannot reach checkpoint storage 's3://bucket/run'",
        "no-bucket": "Checkpoint storage 's3://no-such-bucket-here/run' does not exist",
    }
    for case, (url, options) in cases.items():
        spec = tmp_path / f"{case}.json"
        spec.write_text(
            json.dumps([{**_scenario(case, url, 4, storage_options=options), "strategy": {"pipeline_stages": 1}}])
        )
        start = time.monotonic()
        with pytest.raises(WorkerFailure) as failure:
            launch(
                1,
                ["tests/workers/run_scenarios.py", str(spec), str(tmp_path / "out")],
                log_dir=tmp_path / case,
                timeout=120,
            )
        assert time.monotonic() - start < 90
        log = failure.value.logs[0]
        assert expected[case] in log, log[-3000:]
        assert "StorageError" in log and "Epoch 0" not in log and "training_step" not in log
