"""Mode "sharded": LitData's ``StreamingDataset``, each data-parallel replica reading only its own shard.

LitData splits a dataset's chunks among "ranks" that it finds in ``torch.distributed``; under a pipeline that
world is P x D processes, of which the P stages of one replica must read the same samples. Each replica's loader
is therefore rebuilt with LitData's environment set to (replica index, D) — never the global rank — and with a
local batch of ``batch_size / D``, so that the D local batches of a step make up one global batch.

Resuming: every replica's state carries the number of samples the *whole job* took in the pass
(``sample_in_epoch``: replicas run in lockstep, so any replica's state will do). On the layout and worker count
that wrote a state, LitData's own replay resumes it; on any other, LitData's elastic path (its "canonical" order of
the first layout's stream, restriped onto the present replicas and workers). Global batch ``k`` of a pass is then
the same set of samples on every layout and worker count. A new pass
on a layout other than the first also follows the first layout's order (LitData alone would reshuffle it for the
present layout). Where LitData cannot be exact: with ``drop_last`` (forced here: replicas must stay in lockstep), the
few samples of a pass that do not fill ``num_workers x batch_size`` on every replica can differ between layouts.

Relies on LitData's private ``_DistributedEnv`` and on its state's fields: pinned to :data:`LITDATA_VERSION`.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch.utils.data import DataLoader

from lightning_spot.data.sharded import explain_indivisible_batch
from lightning_spot.data.streams.contract import release_workers
from lightning_spot.data.streams.positions import PositionLog
from lightning_spot.layout import LayoutError

#: the LitData release whose resume fields and environment override this mode is written (and tested) against
LITDATA_VERSION = "0.2.76"


def is_litdata(loader: Any) -> bool:
    """Whether ``loader`` reads a LitData ``StreamingDataset`` (without importing LitData when it is not in use)."""
    dataset = getattr(loader, "dataset", None)
    return isinstance(loader, DataLoader) and type(dataset).__module__.startswith("litdata.")


@contextlib.contextmanager
def replica_environment(dp_size: int, dp_rank: int) -> Iterator[Any]:
    """LitData's view of the job while a replica's loader is built, resumed or measured: ``dp_size`` ranks (one per
    replica, all on one node so that the order does not depend on the machines), this replica being ``dp_rank``."""
    from litdata.utilities.env import _DistributedEnv

    env = _DistributedEnv(dp_size, dp_rank, 1)
    original = _DistributedEnv.__dict__["detect"]
    _DistributedEnv.detect = classmethod(lambda cls: env)
    try:
        yield env
    finally:
        _DistributedEnv.detect = original


def _check_version() -> None:
    import litdata

    if litdata.__version__ != LITDATA_VERSION:
        warnings.warn(
            f"lightning-spot's sharded mode is tested with litdata=={LITDATA_VERSION}, this is {litdata.__version__}: "
            f"its resume relies on LitData's state fields; install `pip install --no-deps litdata=={LITDATA_VERSION}` "
            f"if a resume does not continue at the right sample.",
            stacklevel=3,
        )


class ShardedStreamLoader:
    """This replica's shard of a LitData stream, in local batches of ``batch_size / D``, with Lightning's
    stateful-loader protocol: its state is LitData's after the last *trained* global batch."""

    def __init__(
        self,
        loader: DataLoader,
        *,
        dp_rank: int,
        dp_size: int,
        divisor: int | None,
        progress: Callable[[], int] | None = None,
        weights: Sequence[int] | None = None,
        world_size: int | None = None,
    ) -> None:
        from litdata import StreamingDataLoader, StreamingDataset

        _check_version()
        if not isinstance(loader.dataset, StreamingDataset):
            raise LayoutError(
                f"spot_pipeline reads LitData's StreamingDataset in shards, resumed on any layout; a "
                f"{type(loader.dataset).__name__} is resumed by LitData only on the same layout. Train from one "
                f"StreamingDataset (several datasets can be written into one with litdata.optimize)."
            )
        if weights is not None:
            raise LayoutError(
                "LitData's sharded mode gives every data-parallel replica an equal share of each global batch, but "
                "pipelines of mixed depths train unequal shares. Use pipelines of one depth (pipeline_depths=None), "
                "or a stream with state_dict()/load_state_dict() in global-stream mode."
            )
        rows = int(loader.batch_size or 0)
        micro = (divisor // dp_size) if divisor else 1
        if rows % dp_size or (rows // dp_size) % micro:
            raise LayoutError(explain_indivisible_batch(rows, dp_size, micro if micro > 1 else None, world_size))
        self.dp_rank, self.dp_size, self.progress = dp_rank, dp_size, progress
        self.batch_size = rows
        dataset: Any = loader.dataset
        self.dataset = dataset
        dataset.set_drop_last(True)  # replicas in lockstep: equal numbers of batches
        collate = loader.collate_fn
        collate = getattr(collate, "collate_fn", collate)  # (LitData wraps the user's collate function)
        with replica_environment(dp_size, dp_rank) as env:
            dataset.distributed_env = env
            self.inner = StreamingDataLoader(
                dataset,
                batch_size=rows // dp_size,
                num_workers=loader.num_workers,
                collate_fn=collate,
                pin_memory=loader.pin_memory,
            )
        self._log = PositionLog()  # our state before each of the pass's last global batches
        self._ended = False  # this pass's last batch was read
        self._pending: dict[str, Any] | None = None
        self._template: dict[str, Any] | None = None  # LitData's latest state: it knows the first layout

    def _layout(self) -> tuple[int, int, int]:
        """(replicas, workers, local batch) of this run."""
        return self.dp_size, max(1, self.inner.num_workers), int(self.inner.batch_size or 1)

    def _first_layout(self) -> tuple[int, int, int]:
        """(replicas, workers, local batch) of the run that began the stream: its order is the one kept."""
        if self._template is None:
            return self._layout()
        first = self._template["dataset"]
        return int(first["initial_world_size"]), int(first["initial_num_workers"]), int(first["initial_batch_size"])

    def __len__(self) -> int:
        """Global batches per pass: the first layout's (LitData deals a pass in local batches, whole ones to every
        replica, and drops the rest), on every layout, so that replicas stay in lockstep after any resume."""
        replicas, _, local = self._first_layout()
        samples = sum(end - start for start, end in self.dataset.region_of_interest)
        return (samples // local) // replicas

    def _load(self, litdata_state: dict[str, Any]) -> None:
        """Resume LitData at ``litdata_state``'s position: on the layout and worker count that wrote it, LitData's
        own resume (it replays each worker's prefix); else its elastic path, the first layout's order restriped
        onto the present replicas and workers (it lists the pass's items in every worker: ~2 us per item)."""
        state = copy.deepcopy(litdata_state)
        ds = state["dataset"]
        ds["current_epoch"] = state["current_epoch"]  # (stale with workers: the loader's is right)
        self.dataset.current_epoch = state["current_epoch"]  # (LitData sets it in the workers' copies only)
        self._template = copy.deepcopy(state)
        same = ds.get("resume_mode") != "elastic" and (ds["world_size"], ds["num_workers"], ds["batch_size"]) == (
            self._layout()
        )
        if same and ds["sample_in_epoch"] == 0:  # a pass's start, in LitData's own order for this layout
            self.inner.current_epoch, self.inner.restore = state["current_epoch"] - 1, False
            self.dataset.set_drop_last(True)
            return
        if not same:
            state["num_samples_yielded"] = ds["num_samples_yielded"] = 0  # the job's position: sample_in_epoch
            state["latest_worker_idx"] = 0
            # (LitData's elastic drop_last would drop a pass's last workers x batch samples; __len__ cuts the pass)
            ds["resume_mode"], ds["drop_last"] = "elastic", False
        self.dataset.set_drop_last(ds["drop_last"])
        with replica_environment(self.dp_size, self.dp_rank):
            self.inner.load_state_dict(state)

    def _pass_start(self, epoch: int) -> dict[str, Any]:
        """Our state for the start of LitData's pass ``epoch``: in the first layout's order once that is known."""
        if self._template is None:
            return {"litdata": None, "epoch": epoch}
        state = copy.deepcopy(self._template)
        state["current_epoch"], state["num_samples_yielded"], state["latest_worker_idx"] = epoch, 0, 0
        state["dataset"].update(current_epoch=epoch, sample_in_epoch=0, num_samples_yielded=0)
        return {"litdata": state}

    def __iter__(self) -> Iterator[Any]:
        pending, self._pending = self._pending, None
        if pending is None:  # a new pass in this process (LitData would order it for this layout: keep the first's)
            pending = self._pass_start(self.inner.current_epoch + 1)
            if pending["litdata"] is not None and self._first_layout() == self._layout():
                pending = {"litdata": None, "epoch": self.inner.current_epoch + 1}
            pending["global_batches_done"] = 0
        if pending.get("litdata") is not None:
            self._load(pending["litdata"])
        else:  # LitData's own order for this layout, the first one
            self.inner.current_epoch = int(pending["epoch"]) - 1  # (LitData counts the new pass itself)
            self.inner.restore = False  # (left set when a resumed pass was cut at __len__)
            self.dataset.set_drop_last(True)
        self._ended = False
        self._log.restart(
            int(pending["global_batches_done"]), {k: v for k, v in pending.items() if k in ("litdata", "epoch")}
        )
        source, end = iter(self.inner), len(self)
        while True:
            try:
                if self._log.next >= end:
                    raise StopIteration
                with replica_environment(self.dp_size, self.dp_rank):
                    batch = next(source)
            except StopIteration:
                self._ended = True
                return
            self._template = self.inner.state_dict()
            self._log.record({"litdata": copy.deepcopy(self._template)})
            yield batch

    def close(self) -> None:
        """The end of the fit: LitData's worker processes are shut down now."""
        release_workers(self.inner)

    def mirror(self) -> dict[str, Any]:
        """What :meth:`state_dict` and ``len`` answer from, for a stage that receives the batches instead: the
        batches read, the newest two positions (the others came before), the pass's end and LitData's epoch."""
        return {**self._log.mirror(), "ended": self._ended, "epoch": self.inner.current_epoch}

    def take_mirror(self, fields: dict[str, Any], fresh: bool) -> None:
        """Take :meth:`mirror` of the loader that read the batches (``fresh``: the first of a pass)."""
        self._pending = None
        self._log.take(fields, fresh)
        self._ended = fields["ended"]
        self.inner.current_epoch = fields["epoch"]
        newest = self._log.positions.get(self._log.next, {}).get("litdata")
        if newest is not None:
            self._template = newest

    def state_dict(self) -> dict[str, Any]:
        log = self._log
        if self.progress is None or not log.positions:
            return dict(self._pending or {})
        done = int(self.progress())
        if done not in log.positions:
            raise RuntimeError(f"LitData's position after {done} global batches was not kept (read {log.next})")
        position = log.positions[done]
        if done == log.next and (self._ended or done >= len(self)):  # the pass is over: a resume starts the next
            position, done = self._pass_start(self.inner.current_epoch + 1), 0  # (as Lightning's count: knows len)
        return {"mode": "sharded", "global_batches_done": done, "global_batch_size": self.batch_size, **position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        if state.get("mode") != "sharded":
            raise LayoutError(
                "the checkpoint's data position is not a LitData stream's (it was trained on a map-style Dataset or "
                "another kind of stream): resume with the same kind of training data"
            )
        saved = state.get("global_batch_size")
        if saved != self.batch_size:
            raise LayoutError(
                f"The checkpoint was trained with a global batch of {saved} samples but this run's DataLoader uses "
                f"batch_size={self.batch_size}. Keep batch_size={saved} to continue the same training."
            )
        self._pending = state
        if state.get("litdata") is not None:  # (the first layout: Lightning asks len() before the pass starts)
            self._template = state["litdata"]
