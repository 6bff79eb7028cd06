"""Mode "fixed layout": per-replica streams, each already this replica's part of the data, with a state per replica.

For streams that are split by replica before they reach the strategy: a Hugging Face dataset after
``split_dataset_by_node(ds, rank=..., world_size=...)`` (give it ``trainer.strategy.distributed_sampler_kwargs``:
the replica index and D, not the global rank), torchdata's ``StatefulDataLoader`` (its state is the loader's,
worker processes included), or any loader marked with :func:`fixed_layout`. Each replica's loader yields its
*local* batches (``batch_size`` = global batch / D) and keeps its own position; checkpoints keep every replica's
(the durable tier gathers them into its manifest, a snapshot holds its own rank's). Such a state only means
something for the same D and the same worker count: a resume onto another one stops with an error that names
the modes that would allow it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.utils.data import DataLoader

from lightning_spot.data.streams.contract import check_stream
from lightning_spot.data.streams.global_stream import GlobalStreamLoader
from lightning_spot.layout import LayoutError

MODE = "fixed layout"
_MARK = "_lightning_spot_stream_mode"


def fixed_layout(loader: DataLoader) -> DataLoader:
    """Declare ``loader`` a per-replica stream (mode "fixed layout"); returns it."""
    setattr(loader, _MARK, MODE)
    return loader


def is_fixed_layout(loader: Any) -> bool:
    """Whether ``loader`` is a per-replica stream: declared, torchdata's ``StatefulDataLoader``, or a Hugging Face
    dataset split by node."""
    if getattr(loader, _MARK, None) == MODE:
        return True
    if type(loader).__name__ == "StatefulDataLoader" and type(loader).__module__.startswith("torchdata."):
        return True
    dataset = getattr(loader, "dataset", None)
    return type(dataset).__module__.startswith("datasets.") and getattr(dataset, "_distributed", None) is not None


def _has_state(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class FixedLayoutLoader(GlobalStreamLoader):
    """A replica's own stream in local batches; its state: the position after the last trained batch, tagged
    with the replica index, D and the worker count that it is valid for."""

    def __init__(
        self,
        loader: DataLoader,
        *,
        dp_rank: int,
        dp_size: int,
        divisor: int | None,
        progress: Any = None,
        weights: Sequence[int] | None = None,
        world_size: int | None = None,
    ) -> None:
        if weights is not None:
            raise LayoutError(
                "A per-replica stream (mode 'fixed layout') yields equal local batches, but pipelines of mixed "
                "depths train unequal shares. Use pipelines of one depth, or a whole stream in global-stream mode."
            )
        super().__init__(loader, dp_rank=dp_rank, dp_size=dp_size, divisor=divisor, progress=progress)
        self.workers = loader.num_workers

    def _position_source(self, loader: DataLoader) -> Any:
        if _has_state(loader):  # (torchdata's StatefulDataLoader: the workers' positions too)
            if loader.batch_size is None:
                check_stream(loader)  # (names the missing batch size)
            return loader
        return check_stream(loader)

    def _share(self, batch: Any) -> Any:
        return batch  # already this replica's

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if not state:
            return state
        return {
            "mode": MODE,
            "replica": self.dp_rank,
            "data_parallel": self.dp_size,
            "workers": self.workers,
            "local_batch_size": self.batch_size,
            "global_batches_done": state["global_batches_done"],
            "stream": state["stream"],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        if state.get("mode") != MODE:
            raise LayoutError(
                "the checkpoint's data position is not a per-replica stream's (mode 'fixed layout'): resume with the "
                "same kind of training data"
            )
        saved = (state["data_parallel"], state["workers"])
        if saved != (self.dp_size, self.workers):
            raise LayoutError(
                f"The checkpoint's per-replica streams were read by {saved[0]} data-parallel replicas with "
                f"num_workers={saved[1]}; this run has {self.dp_size} with num_workers={self.workers}. A per-replica "
                f"stream (mode 'fixed layout') resumes only on the same D and worker count: keep them (the pipeline "
                f"depth may change), or feed the whole stream in mode 'global stream' (every replica reads it, any D) "
                f"or LitData's StreamingDataset in mode 'sharded' (any D and worker count)."
            )
        own = state["replicas"].get(str(self.dp_rank)) if "replicas" in state else state
        if own is None or own.get("replica") != self.dp_rank:
            raise LayoutError(
                f"The checkpoint holds no position of replica {self.dp_rank}'s stream (found "
                f"{sorted(state.get('replicas', {})) or state.get('replica')}): it cannot continue that stream."
            )
        if own["local_batch_size"] != self.batch_size:
            raise LayoutError(
                f"The checkpoint's replica streams used batch_size={own['local_batch_size']} but this run's uses "
                f"{self.batch_size}. Keep batch_size={own['local_batch_size']} to continue the same training."
            )
        self._pending = {"global_batches_done": own["global_batches_done"], "stream": own["stream"]}


def replica_states(lightning: dict[str, Any]) -> list[Any] | None:
    """This rank's per-replica stream states in a Lightning checkpoint (``None`` when it has none): what the durable
    tier gathers from every rank."""
    loaders = _combined_loader(lightning)
    if not loaders or not any(isinstance(s, dict) and s.get("mode") == MODE for s in loaders):
        return None
    return [s if isinstance(s, dict) and s.get("mode") == MODE else None for s in loaders]


def merge_replica_states(lightning: dict[str, Any], gathered: Sequence[list[Any] | None]) -> None:
    """Put every replica's stream state (``gathered``: :func:`replica_states` of every rank) into ``lightning``."""
    loaders = _combined_loader(lightning)
    if not loaders:
        return
    for i, state in enumerate(loaders):
        if not (isinstance(state, dict) and state.get("mode") == MODE):
            continue
        replicas = {str(s[i]["replica"]): s[i] for s in gathered if s is not None and s[i] is not None}
        common = {k: state[k] for k in ("mode", "data_parallel", "workers")}
        loaders[i] = {**common, "replicas": replicas}


def _combined_loader(lightning: dict[str, Any]) -> list[Any] | None:
    try:
        loaders = lightning["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    except (KeyError, TypeError):
        return None
    return loaders if isinstance(loaders, list) else None
