"""lightning-spot: train models too large for one GPU on preemptible GPUs with PyTorch Lightning.

import lightning as L
import lightning_spot  # registers strategy="spot_pipeline"

trainer = L.Trainer(accelerator="gpu", devices=8, strategy="spot_pipeline")
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_spot._version import __version__ as __version__
from lightning_spot.checkpoint import CheckpointError, SpotCheckpoint, StorageError
from lightning_spot.checkpoint.tools.consolidate import load_full_state_dict
from lightning_spot.data.sharded import EpochShuffleSampler
from lightning_spot.layout import Layout, LayoutError, PipelineLayout
from lightning_spot.observe.grad_norms import grad_norm
from lightning_spot.observe.throughput import PipelineThroughput
from lightning_spot.observe.timeline import PipelineTimeline
from lightning_spot.partition.cuts import StagePlan, even_cuts, plan_stages
from lightning_spot.partition.discovery import ModelContractError, ModelSplit, discover
from lightning_spot.preemption import PREEMPTED_EXIT_CODE, Notice, PreemptionWatcher
from lightning_spot.runtime.schedules import SCHEDULE_NAMES, resolve_schedule
from lightning_spot.strategy import SpotPipelineStrategy
from lightning_spot.torchft import TorchFT
from lightning_spot.utils.warnings import hide_inapplicable_warnings

SpotPipelineStrategy.register_strategies(StrategyRegistry)
hide_inapplicable_warnings()

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "SCHEDULE_NAMES",
    "CheckpointError",
    "EpochShuffleSampler",
    "Layout",
    "LayoutError",
    "ModelContractError",
    "ModelSplit",
    "Notice",
    "PipelineLayout",
    "PipelineThroughput",
    "PipelineTimeline",
    "PreemptionWatcher",
    "SpotCheckpoint",
    "SpotPipelineStrategy",
    "StagePlan",
    "StorageError",
    "TorchFT",
    "discover",
    "even_cuts",
    "grad_norm",
    "load_full_state_dict",
    "plan_stages",
    "resolve_schedule",
]
