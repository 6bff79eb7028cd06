"""spot_pipeline from LightningCLI YAML: by class_path, and by name through the shipped entry point."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed import launch
from tests.parity import assert_same_params, merged_state, reference_run

CONFIG = """
seed_everything: 7
trainer:
  accelerator: cpu
  devices: 2
  max_steps: 3
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  default_root_dir: {root}
  strategy: {strategy}
  callbacks:
    - class_path: tests.models.SaveFinalState
      init_args:
        dirpath: {out}
model:
  class_path: tests.models.TinyPipelineModel
  init_args:
    optimizer: sgd
data:
  class_path: tests.models.TinyDataModule
  init_args:
    batch_size: 16
"""


BY_CLASS_PATH = """
    class_path: lightning_spot.SpotPipelineStrategy
    init_args:
      pipeline_stages: 2
      microbatches: 2
      schedule: gpipe"""


@pytest.mark.parametrize(
    ("command", "strategy"),
    [
        (["tests/workers/plain_lightning_cli.py"], BY_CLASS_PATH),
        (["-m", "lightning_spot.cli"], "spot_pipeline"),
    ],
    ids=["class_path-in-plain-LightningCLI", "name-through-lightning-spot-entry-point"],
)
def test_lightning_cli_yaml(tmp_path: Path, command: list[str], strategy: str) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(root=tmp_path / "root", out=tmp_path / "out", strategy=strategy))
    launch(2, [*command, "fit", "--config", str(config)], log_dir=tmp_path / "logs", timeout=180)
    ranks = [torch.load(tmp_path / "out" / f"rank{r}.pt") for r in range(2)]
    if strategy == BY_CLASS_PATH:  # by name, the planner picks the layout (for this tiny model: data parallel)
        assert all(0 < len(r["state_dict"]) < 12 for r in ranks), "each rank holds one pipeline stage"
    torch.manual_seed(7)
    ref = reference_run({"model": {"optimizer": "sgd"}, "loader": {"batch_size": 16}, "trainer": {"max_steps": 3}})
    assert_same_params(merged_state(ranks), ref)


def test_console_script_is_installed() -> None:
    exe = Path(sys.executable).parent / "lightning-spot"
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "LightningCLI" in out.stdout
