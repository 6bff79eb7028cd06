"""The strategy's checkpoint hooks: Lightning's save and load, and what ``SpotCheckpoint`` asks of the strategy.

    class SpotPipelineStrategy(..., CheckpointHooks, ...): ...   # save_checkpoint, load_checkpoint, checkpoints...

Saves and loads go through ``PipelineCheckpointIO`` (``checkpoint.pipeline_io``; ``SpotCheckpoint``'s saves use the
same object, as ``checkpoints``): each rank its stages' tensors, by parameter name, onto any layout.
``load_checkpoint`` also takes a peer's state (torchft's join) and records what the run resumed from
(``restored_manifest``). The members ``SpotCheckpoint`` reads are those of ``checkpoint.strategy_api``'s
``CheckpointHost``.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.strategies.parallel import ParallelStrategy
from typing_extensions import override

from lightning_spot.checkpoint.memory.snapshot import SnapshotStore
from lightning_spot.checkpoint.payload import stored_names
from lightning_spot.checkpoint.pipeline_io import PipelineCheckpointIO
from lightning_spot.checkpoint.replica_rules import CheckpointRules, OwnCheckpoints
from lightning_spot.checkpoint.sources import StateSources
from lightning_spot.runtime.engine import PipelineEngine
from lightning_spot.runtime.offload import OptimizerOffload
from lightning_spot.strategy.settings import PipelineSettings
from lightning_spot.torchft.attach import HEAL_URL, ReplicaGroup, healed_checkpoint
from lightning_spot.torchft.checkpoint_rules import ReplicatedCheckpoints
from lightning_spot.torchft.no_replicas import Replicas


class CheckpointHooks(ParallelStrategy):
    """Checkpoints of a pipeline on any layout (a mixin of ``SpotPipelineStrategy``, which sets what is declared
    here)."""

    engine: Optional[PipelineEngine]
    settings: PipelineSettings
    sources: StateSources
    offload: Optional[OptimizerOffload]
    restored_manifest: Optional[dict[str, Any]]
    _replicas: Replicas

    def _engine(self) -> PipelineEngine:
        if self.engine is None:
            raise RuntimeError("spot_pipeline has not been set up yet")
        return self.engine

    @property
    def replicas(self) -> Optional[ReplicaGroup]:
        """This pipeline's torchft replica group (``fault_tolerance="torchft"``, once fitting starts), else None."""
        return self._replicas if isinstance(self._replicas, ReplicaGroup) else None

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @property
    def checkpoints(self) -> PipelineCheckpointIO:
        """This rank's checkpoint reads and writes (once the engine is built)."""
        return PipelineCheckpointIO(self._engine(), self.sources)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer state keyed by parameter name (flattened), so that any layout can read it."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # (a LightningOptimizer's own)
        assert self.lightning_module is not None
        return self.checkpoints.optimizer_state(self.lightning_module, optimizer)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's parameters and buffers under the names checkpoints store (a tied parameter once)."""
        return stored_names(super().lightning_module_state_dict(), self.tied_aliases)

    @property
    def tied_aliases(self) -> dict[str, str]:
        """This rank's other names of tied parameters -> the name checkpoints store them under."""
        return self.engine.ties.aliases if self.engine is not None else {}

    def use_checkpoint_storage(
        self, storage_options: dict[str, Any], run_url: Optional[str] = None, snapshots: Optional[SnapshotStore] = None
    ) -> None:
        """fsspec options for checkpoint URLs (``SpotCheckpoint`` hands over its own; also used by
        ``fit(ckpt_path=URL)`` and ``ModelCheckpoint``), the run directory, where plans are remembered, and
        the in-memory snapshots that ``ckpt_path="snapshot://STEP"`` resumes from."""
        self.sources.use(storage_options, run_url, snapshots)

    def newest_snapshot(self) -> tuple[Optional[int], str]:
        """Collective: the newest step the surviving in-memory snapshots hold completely for this layout."""
        assert self.lightning_module is not None
        return self.sources.newest_snapshot(self.lightning_module, list(self.optimizers), self.tied_aliases)

    @property
    def checkpoint_rules(self) -> CheckpointRules:
        """Who writes checkpoints and which tiers this pipeline keeps (torchft's rules with ``fault_tolerance``)."""
        ft = self.settings.fault_tolerance
        if ft is None:
            return OwnCheckpoints()
        return ReplicatedCheckpoints(str(ft.resolved().replica_group), lambda: self._replicas)

    @property
    def last_global_batch(self) -> Optional[int]:
        """Samples in the last trained global batch (``None`` before the first step)."""
        return self.engine.last_global_batch if self.engine is not None else None

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write a sharded checkpoint directory at ``filepath`` (any fsspec URL; what ModelCheckpoint asks for)."""
        url = self.broadcast(str(filepath))
        self.checkpoints.save(checkpoint, url, storage_options, whole=self.is_global_zero)
        self.barrier("spot_pipeline.save_checkpoint")

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load a checkpoint (or the latest intact one of a run directory) written on any layout onto this one."""
        module, optimizers = self.lightning_module, list(self.optimizers)
        assert module is not None
        url = self.broadcast(str(checkpoint_path))
        if url == HEAL_URL and self.replicas is not None:  # (torchft: a peer's state, taken at the join)
            checkpoint, self.restored_manifest = healed_checkpoint(
                self.replicas, module, optimizers, self._engine(), self.offload
            )
            return checkpoint
        checkpoint, self.restored_manifest = self.checkpoints.load(url, module, optimizers, self.offload)
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # done in load_checkpoint, resharded by parameter name

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # done in load_checkpoint
