"""SpotCheckpoint: train on one layout, resume on another from object storage, same math.

Phase 1 trains 3 steps (stopping in the middle of the first epoch) and checkpoints; phase 2 runs the
same command on another P x D layout, resumes automatically and trains to step 12 (crossing two epoch
boundaries). The result must equal 12 uninterrupted single-process steps (Adam, StepLR, shuffled data).
S3 cases talk HTTP to a real moto server on 127.0.0.1.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.parity import assert_same_params, merged_state, reference_run, run_scenarios

COMMON: dict[str, Any] = {"model": {"scheduler": True}, "loader": {"batch_size": 16, "n": 80, "shuffle": True}}
P2D2 = {"pipeline_stages": 2, "microbatches": 2}
TOTAL_STEPS = 12

# name: (world and strategy of phase 1, world and strategy of phase 2, storage, resume how)
MORPHS: dict[str, tuple[tuple[int, dict], tuple[int, dict], str, str]] = {
    "P2D2-to-P4D1-s3": ((4, P2D2), (4, {"pipeline_stages": 4, "microbatches": 4, "schedule": "gpipe"}), "s3", "auto"),
    "P2D2-to-P1D1": ((4, P2D2), (1, {"pipeline_stages": 1, "microbatches": 2}), "local", "auto"),
    "P2D1-to-P2D2-ckpt_path": ((2, {"pipeline_stages": 2, "microbatches": 4}), (4, P2D2), "local", "ckpt_path"),
    "P2D2-to-P3D1-s3": ((4, P2D2), (3, {"pipeline_stages": 3, "microbatches": 4}), "s3", "auto"),
    # with snapshots: durable checkpoints are the snapshots' files uploaded as they are (kind "shares")
    "P2D2-to-P1D1-snapshots-s3": ((4, P2D2), (1, {"pipeline_stages": 1, "microbatches": 2}), "s3", "auto"),
}
SNAPSHOTS = {"P2D2-to-P1D1-snapshots-s3"}
EMA: dict[str, Any] = {
    "model": {"cls": "TiedEmbeddingModel"},
    "loader": {"batch_size": 16, "n": 64},
    "val_loader": {"batch_size": 16, "n": 32},
    "ema": 0.5,
}
#: EMA cases: validation every N steps (1: after phase 1's last step too; 2: not after it)
EMA_CASES = {"validated": 1, "ended": 2}


def _phase(name: str, strategy: dict, max_steps: int, spot: dict, **extra: Any) -> dict[str, Any]:
    return {
        **COMMON,
        "name": name,
        "strategy": strategy,
        "trainer": {"max_steps": max_steps},
        "spot_checkpoint": spot,
        **extra,
    }


@pytest.fixture(scope="module")
def morphs(tmp_path_factory: pytest.TempPathFactory, s3_endpoint: str) -> dict[str, Any]:
    import s3fs

    tmp = tmp_path_factory.mktemp("morph")
    options = {"endpoint_url": s3_endpoint, "key": "testing", "secret": "testing"}
    fs = s3fs.S3FileSystem(**options)
    runs: dict[str, dict[str, Any]] = {}
    for name, (_, _, where, _) in MORPHS.items():
        if where == "s3":
            bucket = f"morph-{len(runs)}-{tmp.name[-6:].lower().replace('_', '-')}"
            fs.mkdir(bucket)
            runs[name] = {"dirpath": f"s3://{bucket}/runs/{name}", "storage_options": options}
        else:
            runs[name] = {"dirpath": str(tmp / "runs" / name)}
    spot = {n: {**r, "every_n_train_steps": 2, "keep_last": 2} for n, r in runs.items()}
    for name in SNAPSHOTS:  # each phase its own memory: phase 2 reads storage
        spot[name]["snapshot_every_n_train_steps"] = 1
    for name in set(spot) - SNAPSHOTS:  # the durable tier alone: DCP shards
        spot[name]["snapshots"] = False

    jobs: dict[int, list[dict]] = {}
    for name, ((w1, s1), _, _, _) in MORPHS.items():
        memory = {"snapshot_dir": str(tmp / "shm" / name / "1")} if name in SNAPSHOTS else {}
        jobs.setdefault(w1, []).append(_phase(f"{name}-phase1", s1, 3, {**spot[name], **memory}))
    for name, (_, (w2, s2), _, how) in MORPHS.items():
        kwargs = {**spot[name], "resume": how == "auto"}
        if name in SNAPSHOTS:
            kwargs["snapshot_dir"] = str(tmp / "shm" / name / "2")
        extra = {"ckpt_path": runs[name]["dirpath"]} if how == "ckpt_path" else {}
        jobs.setdefault(w2, []).append(_phase(f"{name}-phase2", s2, TOTAL_STEPS, kwargs, **extra))
    # Lightning's EMAWeightAveraging, snapshots in memory and shares in storage: the trained weights come back beside
    # the average, although phase 1's last snapshot is still being copied when the callback swaps its average in for
    # validation ("validated": every step) or copies it in at the end of training ("ended": validation every two
    # steps, not after the last; the copies start late)
    for case, every in EMA_CASES.items():
        ema = {**EMA, "spot_checkpoint": {"dirpath": str(tmp / "runs" / case), "every_n_train_steps": 2}}
        shm = {"snapshot_every_n_train_steps": 1, "snapshot_dir": str(tmp / "shm" / case)}
        validation = {"limit_val_batches": None, "val_check_interval": every}
        jobs[4].append({**ema, "name": f"{case}-phase1", "strategy": P2D2, "trainer": {"max_steps": 3, **validation}})
        jobs[4][-1]["spot_checkpoint"] = {**ema["spot_checkpoint"], **shm}
        if case == "ended":  # (validation comes at once, while the copies are under way; the end only after a delay)
            jobs[4][-1]["slow_snapshot_copies"] = 0.3
        phase2 = {"max_steps": 6, **validation}
        jobs[1].append({**ema, "name": f"{case}-phase2", "strategy": {"pipeline_stages": 1}, "trainer": phase2})
    results: dict[str, list[dict]] = {}
    for world in (2, 4, 1, 3):  # phase 1 of every case runs before its phase 2
        results.update(run_scenarios(world, jobs[world], tmp / f"world{world}", timeout=400))
    return {"results": results, "runs": runs, "fs": fs}


@pytest.mark.parametrize("case", list(EMA_CASES))
def test_ema_weight_averaging_resumes_with_its_trained_weights_and_its_average(case: str, morphs: dict) -> None:
    first, second = morphs["results"][f"{case}-phase1"], morphs["results"][f"{case}-phase2"]
    assert {r["spot"]["saves"][-1]["step"] for r in first} == {3}
    assert second[0]["restored_step"] == 3 and second[0]["restored_kind"] == "shares"
    validation = {"limit_val_batches": None, "val_check_interval": EMA_CASES[case]}
    ref = reference_run({**EMA, "trainer": {"max_steps": 6, **validation}})
    assert_same_params(merged_state(second), ref)
    assert second[0]["metrics"]["val_loss"] == pytest.approx(ref["metrics"]["val_loss"], abs=1e-5)


@pytest.fixture(scope="module")
def uninterrupted() -> dict[str, Any]:
    return reference_run({**COMMON, "trainer": {"max_steps": TOTAL_STEPS}})


@pytest.mark.parametrize("name", list(MORPHS))
def test_resume_on_another_layout_has_the_same_math(name: str, morphs: dict, uninterrupted: dict) -> None:
    first = morphs["results"][f"{name}-phase1"]
    second = morphs["results"][f"{name}-phase2"]
    assert all(r["spot"]["saves"][-1]["step"] == 3 for r in first), "phase 1 checkpoints its last step"
    assert all(r["restored_step"] == 3 for r in second), "phase 2 resumed from step 3, mid-epoch"
    assert_same_params(merged_state(second), uninterrupted)
    for r in second:
        assert r["metrics"]["train_loss"] == pytest.approx(uninterrupted["metrics"]["train_loss"], abs=1e-5)


@pytest.mark.parametrize("name", list(MORPHS))
def test_storage_holds_the_last_committed_checkpoints(name: str, morphs: dict) -> None:
    from lightning_spot.checkpoint.durable.storage import Storage

    run = morphs["runs"][name]
    storage = Storage(run["dirpath"], run.get("storage_options"))
    assert storage.committed() == ["step-000000010", "step-000000012"], "keep_last=2 after saves at 2,3,4,...,12"
    assert storage.step_dirs() == storage.committed(), "no debris left behind"
    manifest = storage.read_json("step-000000012/manifest.json")
    world, strategy = MORPHS[name][1]
    assert manifest["layout"]["pipeline_stages"] == strategy["pipeline_stages"]
    assert manifest["layout"]["world_size"] == world
    assert manifest["data"] == {"global_batch": 16, "samples_consumed": 16 * TOTAL_STEPS}
    assert manifest["step"] == TOTAL_STEPS and manifest["epoch"] == 2
    files = storage.sizes("step-000000012")
    assert {n: f["size"] for n, f in manifest["files"].items()} == {
        n: s for n, s in files.items() if n != "manifest.json"
    }
    if name in SNAPSHOTS:
        assert manifest["kind"] == "shares" and sorted(manifest["shares"]) == [str(r) for r in range(world)]
        assert all(f"rank{r:05d}.safetensors" in files and f"rank{r:05d}.json" in files for r in range(world))
        first = storage.read_json("step-000000010/manifest.json")
        assert first["kind"] == "shares"
    else:
        assert any(n.endswith(".distcp") for n in files) and ".metadata" in files
        assert all(f"rng-rank{r:05d}.json" in files for r in range(world))


def test_async_saves_stall_training_only_briefly(morphs: dict) -> None:
    for r in morphs["results"]["P2D2-to-P4D1-s3-phase2"]:
        saves = r["spot"]["saves"]
        assert len(saves) == 5 and [s["step"] for s in saves] == [4, 6, 8, 10, 12]
        assert all(s["stall_seconds"] < 2.0 for s in saves)


def test_the_summary_counts_the_snapshots_between_saves_and_their_stall(morphs: dict) -> None:
    for r in morphs["results"]["P2D2-to-P1D1-snapshots-s3-phase2"]:
        summary = r["spot"]["summary"]
        assert summary["saves"] == 5, "durable saves at steps 4, 6, ..., 12 (each from a snapshot of its step)"
        assert summary["snapshots"] == 4, "snapshots alone at steps 5, 7, 9, 11"
        assert 0 < summary["snapshot_stall_seconds"] < 8.0
        assert 0 <= summary["snapshot_wait_seconds"] <= summary["snapshot_stall_seconds"]


@pytest.mark.parametrize("name", ["P2D2-to-P3D1-s3", "P2D2-to-P1D1-snapshots-s3"])
def test_load_full_state_dict_and_cli(name: str, morphs: dict, uninterrupted: dict, tmp_path: Path, capsys) -> None:
    from lightning_spot import load_full_state_dict
    from lightning_spot.cli import main

    run = morphs["runs"][name]
    weights = load_full_state_dict(run["dirpath"], run["storage_options"])
    assert_same_params(weights, uninterrupted)

    options = ["--storage-options", json.dumps(run["storage_options"])]
    assert main(["checkpoint", "list", run["dirpath"], *options]) == 0
    listing = capsys.readouterr().out
    assert (
        "step-000000010" in listing and "step-000000012" in listing and name.split("-")[2] in listing.replace("x", "")
    )
    assert main(["checkpoint", "inspect", run["dirpath"], "--verify", *options]) == 0
    assert "samples consumed 192" in capsys.readouterr().out
    out = tmp_path / "model.pt"
    assert main(["checkpoint", "convert", run["dirpath"], str(out), *options]) == 0
    exported = torch.load(out, weights_only=True)  # a plain state dict, no lightning-spot needed
    from tests.models import make_model

    model = make_model(scheduler=True)
    model.load_state_dict(exported)
    assert_same_params(model.state_dict(), uninterrupted)


def test_time_based_checkpoints_are_agreed_by_all_ranks(tmp_path: Path) -> None:
    """every_n_minutes: ranks agree on the step (one all-reduce), so every checkpoint is complete."""
    from tests.distributed import launch

    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "out": str(tmp_path / "out"),
                "run": str(tmp_path / "run"),
                "max_steps": 12,
                "step_seconds": 0.25,
                "every": None,
                "every_minutes": 0.01,
                "keep_last": 20,
                "strategy": {"pipeline_stages": 2, "microbatches": 4},
            }
        )
    )
    launch(2, ["tests/workers/elastic_train.py", str(config)], log_dir=tmp_path / "logs", timeout=240)
    manifests = [json.loads(p.read_text()) for p in sorted((tmp_path / "run").glob("step-*/manifest.json"))]
    periodic = [m["step"] for m in manifests if m["reason"] == "periodic"]
    assert len(periodic) >= 3, periodic  # about one every 0.6 s of a 3 s run
    assert all(len([f for f in m["files"] if f.endswith(".distcp")]) >= 2 for m in manifests), "both ranks wrote"


def test_resumes_at_the_ends_of_epochs_keep_the_order_of_the_data(tmp_path: Path) -> None:
    """Two resumes in a row from checkpoints of an epoch's last batch (5 batches per epoch): Lightning then counts
    one epoch behind, the data order must not (found by a spot replay whose restarts fell on steps 20 and 55)."""
    spot = {"dirpath": str(tmp_path / "run"), "every_n_train_steps": 5, "keep_last": 2}
    phases = [
        _phase(f"epochs-{steps}", {"pipeline_stages": 1}, steps, {**spot, "resume": steps > 5}) for steps in (5, 10, 15)
    ]
    results = run_scenarios(1, phases, tmp_path / "job", timeout=300)
    assert [r["restored_step"] for r in (results["epochs-10"][0], results["epochs-15"][0])] == [5, 10]
    assert_same_params(merged_state(results["epochs-15"]), reference_run({**COMMON, "trainer": {"max_steps": 15}}))
