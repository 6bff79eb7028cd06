"""Where a run resumes from, and the one patch of Lightning's resume that makes ``fit`` restore it.

    override = ResumeOverride.of(trainer)                  # patches the checkpoint connector's resume_start once
    override.add("spot_checkpoint", newest_of_the_run)     # fit() without ckpt_path: the run's newest checkpoint
    override.add("torchft_heal", lambda _: HEAL_URL, first=True, once=True)   # a peer's state, whatever was asked
    override.remove("spot_checkpoint")                     # the last one gone: Lightning's own method is back

Lightning resolves ``ckpt_path`` before callbacks and strategies run; its checkpoint connector's ``resume_start``
is where that path is used, so the path is chosen there. Each chooser gets the path chosen so far (``None``: none)
and returns the path to use, or ``None`` to leave it; ``first`` choosers run before the others.
``newest_state`` is SpotCheckpoint's choice: the newest of the run's in-memory snapshot and committed checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Optional

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_spot.checkpoint.durable.storage import Storage, step_of
from lightning_spot.checkpoint.memory.snapshot import SNAPSHOT_SCHEME
from lightning_spot.checkpoint.strategy_api import CheckpointHost
from lightning_spot.utils.distributed import broadcast_object

log = logging.getLogger(__name__)

Chooser = Callable[[Optional[str]], Optional[str]]
_ATTRIBUTE = "_spot_resume_override"


class ResumeOverride:
    """The choosers of one trainer's resume path (see the module's text)."""

    def __init__(self, connector: Any) -> None:
        self._connector = connector
        self._original = connector.resume_start
        self._choosers: list[tuple[str, Chooser, bool]] = []
        connector.resume_start = self._resume_start

    @classmethod
    def of(cls, trainer: L.Trainer) -> ResumeOverride:
        """The trainer's override, made (and Lightning's method patched) on first use."""
        connector = trainer._checkpoint_connector
        override = getattr(connector, _ATTRIBUTE, None)
        if override is None:
            override = cls(connector)
            setattr(connector, _ATTRIBUTE, override)
        return override

    def add(self, name: str, choose: Chooser, *, first: bool = False, once: bool = False) -> None:
        """Register ``choose`` under ``name`` (replacing one of that name); ``once``: dropped after its resume."""
        self._choosers = [c for c in self._choosers if c[0] != name]
        entry = (name, choose, once)
        self._choosers = [entry, *self._choosers] if first else [*self._choosers, entry]

    def remove(self, name: str) -> None:
        """Drop a chooser; with none left, Lightning's ``resume_start`` is put back."""
        self._choosers = [c for c in self._choosers if c[0] != name]
        if not self._choosers and getattr(self._connector, _ATTRIBUTE, None) is self:
            self._connector.resume_start = self._original
            delattr(self._connector, _ATTRIBUTE)

    def _resume_start(self, checkpoint_path: Any = None, weights_only: Any = None) -> None:
        for name, choose, once in list(self._choosers):
            chosen = choose(checkpoint_path)
            if chosen is not None:
                checkpoint_path = chosen
            if once:
                self.remove(name)
        self._original(checkpoint_path, weights_only)


def newest_state(trainer: L.Trainer, storage: Storage, snapshots: Optional[CheckpointHost]) -> Optional[str]:
    """Where a run resumes from (collective): its newest in-memory snapshot (asked of ``snapshots``, the strategy,
    when the run keeps them) when it is at least as new as the newest committed checkpoint in ``storage``, else
    that checkpoint; ``None``: neither (a fresh start). Unreachable storage reads as none when memory may hold the
    state."""
    found = _committed(trainer, storage, memory=snapshots is not None)
    in_memory, why = snapshots.newest_snapshot() if snapshots is not None else (None, "")
    newest_stored = step_of(found[-1]) if found else -1
    if in_memory is not None and in_memory >= newest_stored:
        rank_zero_info(
            f"SpotCheckpoint: resuming from the in-memory snapshot of step {in_memory} (the newest "
            f"checkpoint in {storage.url} is {'of step ' + str(newest_stored) if found else 'none'})"
        )
        return f"{SNAPSHOT_SCHEME}{in_memory}"
    if not found:
        return None
    if snapshots is not None:
        reason = f"it is older (step {in_memory})" if in_memory is not None else why
        rank_zero_info(f"SpotCheckpoint: not resuming from memory: {reason}")
    rank_zero_info(f"SpotCheckpoint: resuming from {storage.url} ({len(found)} committed checkpoints)")
    return storage.url


def _committed(trainer: L.Trainer, storage: Storage, memory: bool) -> list[str]:
    """The run's committed checkpoints (read on rank 0, shared); with ``memory``, unreachable storage reads as
    none (with a warning)."""
    found, problem = None, None
    if trainer.is_global_zero:
        try:
            found = storage.committed()
        except Exception as err:  # unreachable storage: memory may still hold the state
            if not memory:
                raise
            problem = f"{type(err).__name__}: {err}"
    found, problem = broadcast_object((found, problem))
    if problem:
        log.warning("lightning-spot: cannot list checkpoints in %s (%s); trying host memory", storage.url, problem)
    return found or []
