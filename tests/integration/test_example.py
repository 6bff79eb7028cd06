"""The example GPT trains (loss falls) as a script and through LightningCLI, with Lightning's own launcher."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tests.distributed import run_command as run_with_lightning_launcher


def test_example_script_trains_and_resumes_on_another_layout(tmp_path: Path) -> None:
    common = [
        sys.executable,
        "examples/gpt/train.py",
        "--devices",
        "2",
        "--val-every",
        "4",
        "--checkpoint-every",
        "4",
        "--root",
        str(tmp_path),
    ]
    out = run_with_lightning_launcher([*common, "--max-steps", "8", "--microbatches", "2"])
    line = re.search(
        r"done: layout (\S+), train_loss ([\d.]+), val_loss ([\d.]+), val_ppl ([\d.]+), ([\d.]+) samples/s", out
    )
    assert line, out[-3000:]
    layout, train_loss, _val_loss, val_ppl, samples = line.groups()
    assert layout == "P2xD1"
    assert float(train_loss) < 5.2  # ln(256) = 5.55 at the start: it learned something
    assert 1.0 < float(val_ppl) < 256
    assert float(samples) > 0
    assert (tmp_path / "spot_checkpoints" / "step-000000008" / "manifest.json").is_file()
    assert re.search(r"Epoch 0/0\b", out) and not re.search(r"Epoch \d+/-", out), "8 steps of a 35-batch epoch"

    # the same command on another layout continues from the checkpoint, with the weights in host memory
    # (each layer's on the device only while it computes: LoopedBFS, one layer per stage)
    streamed = ["--schedule", "LoopedBFS", "--offload", "parameters"]
    out = run_with_lightning_launcher(
        [*common, "--max-steps", "12", "--pipeline-stages", "1", "--microbatches", "4", *streamed]
    )
    assert "resumed from step 8" in out and "done: layout P1xD2" in out, out[-3000:]
    assert "LoopedBFS M=4" in out, out[-3000:]
    assert (tmp_path / "spot_checkpoints" / "step-000000012" / "manifest.json").is_file()


def test_the_demos_bar_counts_the_epochs_a_run_bounded_by_steps_takes() -> None:
    """Lightning's bar reads "Epoch 3/-2" with ``max_steps`` alone (``max_epochs - 1``); the demo's shows the epoch in
    which the run ends."""
    from types import SimpleNamespace

    from examples.gpt.progress import last_epoch

    def trainer(**kw: float) -> SimpleNamespace:
        base = {"max_epochs": -1, "max_steps": 120, "global_step": 0, "num_training_batches": 35}
        return SimpleNamespace(**{**base, "accumulate_grad_batches": 1, **kw})

    assert last_epoch(trainer(), 0) == 3  # 120 steps of 35-batch epochs end in the fourth
    assert last_epoch(trainer(global_step=105), 3) == 3
    assert last_epoch(trainer(accumulate_grad_batches=5), 0) == 17  # 7 steps an epoch
    assert last_epoch(trainer(max_epochs=5), 0) == 4
    assert last_epoch(trainer(num_training_batches=float("inf")), 2) is None  # a stream: no end shown


@pytest.mark.slow
def test_example_streams_token_shards_and_resumes_on_another_layout(tmp_path: Path) -> None:
    """``--stream``: the text written as token shards and read back as a stream (global-stream mode); the same
    command on another layout resumes at the sample after the last trained batch and goes on learning."""
    common = [sys.executable, "examples/gpt/train.py", "--devices", "2", "--val-every", "4", "--stream"]
    common += ["--checkpoint-every", "4", "--root", str(tmp_path), "--timeline-steps", "0"]
    out = run_with_lightning_launcher([*common, "--max-steps", "8", "--microbatches", "2"])
    assert "done: layout P2xD1" in out, out[-3000:]
    shards = sorted(p.name for p in (tmp_path / "token_shards").iterdir())
    assert shards[0] == "index.json" and len(shards) > 2 and not any(n.endswith(".tmp") for n in shards)
    out = run_with_lightning_launcher([*common, "--max-steps", "12", "--pipeline-stages", "1", "--microbatches", "2"])
    line = re.search(r"done: layout P1xD2, train_loss ([\d.]+)", out)
    assert "resumed from step 8" in out and line, out[-3000:]
    assert float(line.group(1)) < 5.2  # ln(256) = 5.55 at the start


@pytest.mark.slow
def test_example_reads_litdata_shards_and_resumes_on_another_layout(tmp_path: Path) -> None:
    """``--litdata``: the windows written with LitData's optimize and read by its StreamingDataset (sharded mode:
    each replica its own shard); P2xD1 then P1xD2, which resumes at the next global batch and goes on learning."""
    pytest.importorskip("litdata")
    common = [sys.executable, "examples/gpt/train.py", "--devices", "2", "--val-every", "4", "--litdata"]
    common += ["--checkpoint-every", "4", "--root", str(tmp_path), "--timeline-steps", "0"]
    out = run_with_lightning_launcher([*common, "--max-steps", "8", "--microbatches", "2"])
    assert "done: layout P2xD1" in out, out[-3000:]
    assert (tmp_path / "litdata" / "index.json").is_file()
    out = run_with_lightning_launcher([*common, "--max-steps", "12", "--pipeline-stages", "1", "--microbatches", "2"])
    line = re.search(r"done: layout P1xD2, train_loss ([\d.]+)", out)
    assert "resumed from step 8" in out and line, out[-3000:]
    assert float(line.group(1)) < 5.2  # ln(256) = 5.55 at the start
    manifest = json.loads((tmp_path / "spot_checkpoints" / "step-000000012" / "manifest.json").read_text())
    data = manifest["lightning"]["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert data["mode"] == "sharded" and data["litdata"]["dataset"]["initial_world_size"] == 1, "P2xD1's order kept"


@pytest.mark.slow
def test_example_lightning_cli_config(tmp_path: Path) -> None:
    exe = str(Path(sys.executable).parent / "lightning-spot")
    out = run_with_lightning_launcher(
        [
            exe,
            "fit",
            "--config",
            "examples/gpt/config.yaml",
            "--trainer.devices",
            "2",
            "--trainer.max_steps",
            "6",
            "--trainer.val_check_interval",
            "3",
            "--model.max_steps",
            "6",
            "--trainer.default_root_dir",
            str(tmp_path),
        ]
    )
    assert re.search(r"spot_pipeline plan: P\dxD\d, \d+ micro-batches", out), out[-3000:]  # planned: all "auto"
    assert re.search(
        r"throughput \(P\dxD\d [^)]*\): [\d.]+ samples/s, \d+ tokens/s, .*bubble [\d.]+% on rank 0", out
    ), out[-3000:]
    assert (tmp_path / "lightning_logs" / "version_0" / "config.yaml").is_file()


@pytest.mark.slow
def test_hf_llama_example_trains_through_script_and_cli(tmp_path: Path) -> None:
    """The Hugging Face Llama example learns (loss below ln 256) as a script and through LightningCLI."""
    pytest.importorskip("transformers")
    out = run_with_lightning_launcher(
        [
            sys.executable,
            "examples/hf_llama/train.py",
            "--devices",
            "2",
            "--max-steps",
            "24",
            "--val-every",
            "12",
            "--root",
            str(tmp_path / "script"),
        ]
    )
    line = re.search(r"done: layout (\S+), train_loss ([\d.]+), val_loss ([\d.]+)", out)
    assert line and line.group(1) == "P2xD1", out[-3000:]
    assert float(line.group(2)) < 5.2 and float(line.group(3)) < 5.2  # ln(256) = 5.55 at the start
    assert "of `model.model.layers` (4 blocks)" in out  # found by layers="auto"
    exe = str(Path(sys.executable).parent / "lightning-spot")
    out = run_with_lightning_launcher(
        [
            exe,
            "fit",
            "--config",
            "examples/hf_llama/config.yaml",
            "--trainer.devices",
            "2",
            "--trainer.max_steps",
            "6",
            "--model.max_steps",
            "6",
            "--trainer.val_check_interval",
            "3",
            "--trainer.default_root_dir",
            str(tmp_path / "cli"),
        ]
    )
    assert re.search(r"throughput \(P2xD1 1F1B M=4\): [\d.]+ samples/s", out), out[-3000:]
