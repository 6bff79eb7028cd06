"""This pipeline as one torchft replica group: a quorum per step, weighted gradient averaging, commit or run again.

    group = ReplicaGroup(settings, group_rank=pp_rank, group_size=P, state_dict=...)
    group.join()                                   # at setup: the first quorum; may take a peer's state
    group.overlap(params, tied, loss_weights)      # the gradients to average (sent during the backward if asked)
    share, size = group.begin_step(batch, m, step, again)  # training_step: this replica's rows of the global batch
    factor = group.batch_done(weight)              # after its schedule: what its gradients are multiplied by
    closure = group.committed(closure, weight, keep)  # optimizer_step: the optimizer steps only on a commit
                                                   # (its logs are replayed then), and the next quorum is asked
                                                   # for (it overlaps the update)
    group.shutdown()

Every rank of the pipeline has a torchft ``Manager`` (stage ``k`` of every pipeline share one reconfigurable gloo
group); rank 0's manager talks to the lighthouse. Quorums are synchronous — asked for right after the commit, in
a thread, and waited for when the next step starts: a joiner heals before that step (a peer hands its state over
only at a step boundary) and trains its share of it like any other replica.

With ``accumulate_grad_batches = k > 1`` a quorum holds for the window of ``k`` batches (a peer joins only at a
window's boundary). Each batch's weight (samples, or items of a loss averaged over items) and logged sums are summed
over the quorum right after its schedule (one small all-reduce per batch), so that its gradients enter ``.grad`` as
its part of the whole batch's mean, whatever the other batches' sizes; the commit then sums ``.grad`` over the
pipelines. A window that does not commit is run again whole with the next quorum: its earlier batches through the
``again`` each one left (the strategy's step on the same batch), its last through Lightning's closure.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.distributed import ReduceOp

from lightning_spot.layout import LayoutError
from lightning_spot.preemption import PREEMPTED_EXIT_CODE
from lightning_spot.runtime.clock import StepClock
from lightning_spot.runtime.held_logs import HeldLogs
from lightning_spot.runtime.loss_weights import LossWeights
from lightning_spot.runtime.step_runner import batch_size_of
from lightning_spot.torchft.arrival import Arrival
from lightning_spot.torchft.batch_split import participant_rows, take_rows
from lightning_spot.torchft.config import TorchFT, check_reachable, require_torchft
from lightning_spot.torchft.early_buckets import EarlyBuckets
from lightning_spot.torchft.heal_across import heal_source_rank, healed_across, serves_unassigned
from lightning_spot.torchft.leave import LeaveOnSignal
from lightning_spot.torchft.mixed_quorum import BrokenReduce, HolderReduce, quorum_plans
from lightning_spot.torchft.peer_exits import PeerExits
from lightning_spot.torchft.process_groups import cross_pipeline_group
from lightning_spot.torchft.running_quorum import (
    layouts_in,
    layouts_refusal,
    parse_replica_id,
    read_running,
    replica_id,
)
from lightning_spot.utils.distributed import all_gather_object, broadcast_object
from lightning_spot.watchdog import PEER_LOST_EXIT_CODE, CoordinatorLostError

log = logging.getLogger(__name__)


#: seconds between the quorums a joining pipeline asks for while live pipelines ahead of it are not in its quorum
JOIN_RETRY_SECONDS = 0.5
#: after a restart of the lighthouse, how long a quorum of fewer pipelines than the last is asked again
LIGHTHOUSE_RESTART_WAIT_S = 5.0
#: commits between the re-measured batch shares: each pipeline's rows in proportion to its speed (rows per second of
#: its last schedule), agreed over the last stages and sent to the rest of each pipeline at these steps
SHARES_EVERY = 10


class _RecordedClient:
    """torchft's manager client with the last quorum it got kept (its members' replica ids, which the manager does
    not keep): a stand-in for ``Manager._client`` that passes every call through."""

    def __init__(self, inner: Any, seen: Callable[[Any], None] = lambda result: None) -> None:
        self._inner = inner
        self.last: Any = None
        self._seen = seen

    @classmethod
    def install(cls, manager: Any, seen: Callable[[Any], None] = lambda result: None) -> _RecordedClient | None:
        """``seen``: called with each quorum result before the manager acts on it (configures its group)."""
        inner = getattr(manager, "_client", None)
        if inner is None:  # (another torchft: the layouts are then checked on the lighthouse's page only)
            return None
        recorded = cls(inner, seen)
        manager._client = recorded
        return recorded

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        self.last = self._inner._quorum(*args, **kwargs)
        self._seen(self.last)
        return self.last

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _map_heal_ranks(source_rank: Callable[[int], int]) -> None:
    """Make torchft's heal ask the peer for the state of ``source_rank(its rank)`` instead of its own rank (torchft
    builds a ``ManagerClient`` for the peer and asks it for the checkpoint of ``group_rank``: a joiner deeper than the
    peer has ranks the peer lacks). One replica group per process: the last one installed maps."""
    import torchft.manager as manager_module

    real = getattr(manager_module.ManagerClient, "_real", manager_module.ManagerClient)

    class _Mapped:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._inner = real(*args, **kwargs)

        def _checkpoint_metadata(self, rank: int, *args: Any, **kwargs: Any) -> Any:
            return self._inner._checkpoint_metadata(source_rank(rank), *args, **kwargs)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

    _Mapped._real = real  # type: ignore[attr-defined]
    manager_module.ManagerClient = _Mapped


class _StagePG:
    """torchft's per-stage process group for the manager, left unconfigured for a quorum whose pipelines cut the
    model differently (stage ``k`` of one is not stage ``k`` of another; ``mixed_quorum.HolderReduce`` reduces
    those): every other call passes through."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.mixed = False
        #: the quorum's step, added to the store prefix torchft gives (``s12``): a restarted lighthouse numbers its
        #: quorums from 1 again, and the keys an earlier quorum of that number left in the store must not be read
        self.epoch = ""
        #: how the members meet before the group is configured (set once the replica group exists)
        self.arrival: Arrival | None = None

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int, *args: Any, **kw: Any) -> None:
        """(torchft's quorum thread) the members meet first (``arrival``): one gone or giving up fails this at once,
        and torchft reports it as the step's error (the step is run again with the next quorum)."""
        if self.mixed:
            return
        addr = f"{store_addr}/{self.epoch}" if self.epoch else store_addr
        try:
            if self.arrival is not None:
                self.arrival.meet(f"{addr}/meet", rank, world_size)
            self._inner.configure(addr, replica_id, rank, world_size, *args, **kw)
        except Exception as err:
            if self.arrival is not None:
                self.arrival.abandon(f"{addr}/meet", f"{replica_id} rank {rank}: {err}")
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def lighthouse_restarted(last: tuple[int | None, tuple[str, ...]], now: tuple[int | None, tuple[str, ...]]) -> bool:
    """Whether quorum ``now`` ((id, members)) comes from a lighthouse that restarted since quorum ``last``: a lower
    id, or the same id with other members (a lighthouse keeps a quorum's id while its members stay, and numbers a
    new one higher; a restarted one numbers from 1 again, so after a restart whose quorum kept its members until the
    next restart, the ids are equal)."""
    if last[0] is None or now[0] is None:
        return False
    return now[0] < last[0] or (now[0] == last[0] and now[1] != last[1])


class StageModel(NamedTuple):
    """What this rank trains, for quorums of pipelines cut otherwise (set at attach): the module, the model's split,
    this pipeline's stage plan, its process group and the model's tied parameters."""

    module: Any
    split: Any
    plan: Any
    group: Any
    ties: tuple[Any, ...] = ()


class QuorumError(ConnectionError):
    """No quorum that this pipeline may train in (an error of the job: it ends with exit code 1)."""


class LighthouseLostError(QuorumError, CoordinatorLostError):
    """No quorum from the lighthouse within ``quorum_timeout``: the job's coordinator is gone. Every rank exits with
    the lost-peer code (69), which schedulers relaunch; the pipelines resume from their durable checkpoints."""


class ReplicaGroup:
    """This rank's torchft manager and the bookkeeping of quorums, commits and discarded steps."""

    def __init__(
        self,
        settings: TorchFT,
        *,
        group_rank: int,
        group_size: int,
        state_dict: Callable[[], Any],
        clock: StepClock | None = None,
        layout: str = "",
        device: torch.device | None = None,
    ) -> None:
        require_torchft()
        from torchft import Manager

        settings = settings.resolved()
        assert settings.lighthouse is not None
        if group_rank == 0:
            check_reachable(settings.lighthouse, settings.connect_timeout)
        self.settings = settings
        self.manager_rank = group_rank
        #: where the tensors between pipelines live (their process groups: NCCL on CUDA, gloo elsewhere)
        self.device = device or torch.device("cpu")
        self._pg = _StagePG(cross_pipeline_group(self.device, timedelta(seconds=settings.timeout)))
        self.manager = Manager(
            pg=self._pg,
            load_state_dict=self._keep_state,
            state_dict=self._state_at_boundary,
            min_replica_size=settings.min_replicas,
            use_async_quorum=False,
            timeout=timedelta(seconds=settings.timeout),
            quorum_timeout=timedelta(seconds=settings.quorum_timeout),
            connect_timeout=timedelta(seconds=settings.connect_timeout),
            # a lighthouse that restarts (``lightning-spot coordinator`` under a supervisor) is asked again, every
            # quorum_timeout / (retries + 1) s, rather than failing the step
            quorum_retries=settings.quorum_retries,
            rank=group_rank,
            world_size=group_size,
            lighthouse_addr=settings.lighthouse,
            replica_id=replica_id(str(settings.replica_group), layout),
            init_sync=False,  # every pipeline starts from the same seed: nothing to copy at step 0
        )
        self._state_dict = state_dict
        self.arrival = Arrival(self._quorum_alive, timeout=settings.timeout, connect_timeout=settings.connect_timeout)
        self._pg.arrival = self.arrival
        #: this pipeline's stages and cuts (``running_quorum.layout_tag``), carried by its replica id
        self.layout = layout
        #: the last quorum torchft's client got (its members' replica ids carry their layouts)
        self._client = _RecordedClient.install(self.manager, self._seen_quorum)
        #: set while this rank waits at a step boundary (its state is whole then: a peer may take it)
        self._boundary = threading.Event()
        #: the next step's quorum, asked for right after the commit (see :meth:`prefetch`)
        self._next_quorum: threading.Thread | None = None
        self._next_quorum_error: BaseException | None = None
        self._unused_quorum = False
        self._joining = False
        self._first_step = True
        #: a peer's state taken at :meth:`join`, until Lightning restores it
        self.healed_state: Any = None
        #: pipelines in the current quorum (this one included) and this one's place among them
        self.participants = 0
        self.participant_rank = 0
        #: steps run again because they did not commit; quorum changes seen
        self.discarded = 0
        self.quorum_changes = 0
        self.last_quorum_seconds = 0.0
        self._events: list[dict[str, Any]] = []
        #: the gradient buckets that go out during the backward (:meth:`overlap`), and what weights the losses
        self.buckets: EarlyBuckets | None = None
        self._loss_weights: LossWeights | None = None
        #: the logged values of the step in flight: summed over the quorum with the gradients, logged on a commit
        self.held_logs: HeldLogs | None = None
        #: traces the quorum and the all-reduce with the commit vote when a timeline records
        self.clock = clock
        #: seconds spent, over the run: in quorums, in the gradient all-reduce, in the commit vote
        self.seconds = {"quorum": 0.0, "all-reduce": 0.0, "commit": 0.0}
        #: the batches per optimizer step (``accumulate_grad_batches``: Lightning's, read at each window's start)
        self.accumulation: Callable[[], int] = lambda: 1
        #: what a training step changes besides its gradients (``PipelineEngine.keep_step``), taken at a window's start
        self.keep: Callable[[], Callable[[], None]] | None = None
        #: (k > 1) how to run each batch of the open window again, and what undoes the window; None: no window open
        self._window: list[Callable[[], None]] | None = None
        self._window_undo: Callable[[], None] | None = None
        #: the next window is one run again: its quorum admits no joiner (Lightning's loop is inside the window)
        self._window_again = False
        #: (pipelines of other cuts in the quorum) what this rank's stage is (the module, the model's split, its
        #: stage in its pipeline), set at attach, and the reduction among each parameter's holders, per quorum
        self.model: StageModel | None = None
        self._mixed: HolderReduce | BrokenReduce | None = None
        self._mixed_quorum = -1
        #: the rank of the peer torchft heals this rank from (``_heal_source``), set before its heal asks for it
        self._heal_from = group_rank
        _map_heal_ranks(lambda rank: self._heal_from if rank == self.manager_rank else rank)
        #: the last quorum's id and members (a lower id next, or the same with other members: the lighthouse restarted)
        self._last_quorum: tuple[int | None, tuple[str, ...]] = (None, ())
        #: seconds of this rank's last schedule (``PipelineEngine.last_step_seconds``), set at attach: its speed
        self.pace: Callable[[], float] | None = None
        #: each pipeline's speed as the last stages summed it at the last commit, with the quorum it was measured in;
        #: the speeds the shares follow now (the same on every rank of every pipeline), and this pipeline's rows
        self._measured: tuple[list[float], int] | None = None
        self.shares: tuple[list[float], int] | None = None
        self.rows = 0
        #: (on the first rank) the exit of another rank of the pipeline, seen at once (set at attach)
        self.peer_exits: PeerExits | None = None
        #: SIGTERM (its torchrun stopping it, or a notice) makes the pipeline leave at once
        self._leave = LeaveOnSignal(self._stop_manager, who=f"pipeline {settings.replica_group} rank {group_rank}")
        self._leave.start()

    def _seen_quorum(self, result: Any) -> None:
        """(torchft's quorum thread, before its manager configures its group) a quorum of pipelines that cut the
        model differently leaves torchft's per-stage group unconfigured."""
        tags = {parsed[1] for parsed in map(parse_replica_id, getattr(result, "replica_ids", []) or []) if parsed}
        self._pg.mixed = len(tags) > 1
        self._pg.epoch = f"s{getattr(result, 'max_step', 0)}"
        self._heal_from = self._heal_source(result)
        if self._pg.mixed and serves_unassigned(result):
            self._serve_state(int(result.max_step))

    def _serve_state(self, step: int) -> None:
        """(torchft's quorum thread) Serve this rank's state at ``step`` to whoever asks, as torchft's transport does
        for the joiners it assigned to this rank: a joiner cut otherwise completes its state from the other ranks of
        the peer it heals from, which torchft assigned to other peers (``heal_across.serves_unassigned``). The state
        stays served until this rank's commit vote, which waits for the transfers to end."""
        try:
            self.manager._checkpoint_transport.send_checkpoint(
                dst_ranks=[],
                step=step,
                state_dict=self.manager._manager_state_dict(),
                timeout=timedelta(seconds=self.settings.timeout),
            )
        except Exception as err:  # (the joiner's fetch fails; this step does not commit)
            log.warning(
                "lightning-spot: rank %d could not serve its state at step %d: %s", self.manager_rank, step, err
            )
            self.manager.report_error(err)

    def _quorum_alive(self) -> bool:
        """Whether every pipeline of the last quorum still heartbeats to the lighthouse (True when its page cannot
        be read: a lighthouse restarting says nothing)."""
        result = self._client.last if self._client is not None else None
        ids = list(getattr(result, "replica_ids", None) or [])
        assert self.settings.lighthouse is not None
        running = read_running(self.settings.lighthouse, timeout=min(1.0, self.settings.connect_timeout))
        return running is None or not running.stopped(ids)

    def _heal_source(self, result: Any) -> int:
        """The rank of the peer that torchft heals this rank from in quorum ``result``: its own rank, unless the
        peer is shallower than this pipeline (``heal_across.heal_source_rank``)."""
        ids = getattr(result, "replica_ids", None) or []
        source = getattr(result, "recover_src_replica_rank", None)
        if not getattr(result, "heal", False) or self.model is None or source is None or source >= len(ids):
            return self.manager_rank
        parsed = parse_replica_id(ids[source])
        if parsed is None or parsed[1] == self.layout:
            return self.manager_rank
        return heal_source_rank(self.manager_rank, self._stored_names(), self.model.split, parsed[1])

    def _stored_names(self) -> list[str]:
        """The stored names of this rank's parameters and buffers (what a heal from a peer cut otherwise needs)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        assert self.model is not None
        return list(get_model_state_dict(self.model.module))

    def _use_mixed(self) -> None:
        """After a quorum: with pipelines of other cuts in it, reduce each parameter among its holders (groups made
        once per quorum, from its store); else torchft's per-stage group."""
        result = self._client.last if self._client is not None else None
        plans = quorum_plans(result.replica_ids, self.model.split) if result is not None and self.model else None
        if plans is None:
            if self._mixed is not None:
                self._mixed.abort()
            self._mixed, self._mixed_quorum = None, -1
            return
        assert result is not None
        if self._mixed is not None and self._mixed_quorum == result.quorum_id:
            return
        if self._mixed is not None:
            self._mixed.abort()
        assert self.model is not None and self.buckets is not None
        module, split, _, pp_group, ties = self.model
        timeout = timedelta(seconds=self.settings.timeout)
        # torchft spreads its stores over the quorum by stage (stage k's is member k's): every rank takes the one
        # its pipeline's first rank was given, member 0's, so that the holders of every group meet in one store
        store = broadcast_object(result.store_address if self.manager_rank == 0 else None, group=pp_group)
        prefix = f"{store}/lightning-spot/{result.quorum_id}/s{result.max_step}"  # (see _StagePG.epoch)

        made: list[tuple[str, Any]] = []

        def group(key: str, rank: int, size: int) -> Any:
            pg = cross_pipeline_group(self.device, timeout)
            made.append((f"{prefix}/{key}", pg))
            self.arrival.meet(f"{prefix}/{key}/meet", rank, size)
            pg.configure(f"{prefix}/{key}", str(self.settings.replica_group), rank, size)
            return pg

        try:
            self._mixed = HolderReduce(
                module, self.buckets.params, split, plans, me=(self.participant_rank, self.manager_rank), pg=group,
                ties=ties, device=self.device,
            )  # fmt: skip
        except Exception as err:  # (a member gone or giving up: this step does not commit, the next quorum is asked)
            why = f"pipeline {self.settings.replica_group} rank {self.manager_rank}: {err}"
            for addr, pg in made:
                self.arrival.abandon(f"{addr}/meet", why)
                with contextlib.suppress(Exception):
                    pg.abort()
            log.warning("lightning-spot: %s; this step is run again with the next quorum", why.splitlines()[0][:300])
            self.manager.report_error(err)
            self._mixed = BrokenReduce(err)
        self._mixed_quorum = result.quorum_id

    def _keep_state(self, state: Any) -> None:
        """A peer's state, torchft's heal of this stage; from a peer cut otherwise, completed with what its other
        ranks hold of this rank's layers (``heal_across``)."""
        if self.model is not None and isinstance(state, dict) and state.get("layout") not in (None, self.layout):
            try:
                state = healed_across(
                    state,
                    layout=self.layout,
                    rank=self._heal_from,
                    names=self._stored_names(),
                    split=self.model.split,
                    fetch=self._fetch_peer_rank,
                )
            except Exception as err:  # (a peer gone meanwhile: no state taken; the join asks again)
                log.warning(
                    "lightning-spot: pipeline %s could not complete its state from the peer's other ranks (%s: %s); "
                    "it asks again",
                    self.settings.replica_group,
                    type(err).__name__,
                    str(err).splitlines()[0][:200] if str(err) else "",
                )
                self.manager.report_error(err)
                return
        self.healed_state = state

    def _fetch_peer_rank(self, rank: int) -> Any:
        """The state rank ``rank`` of the peer this pipeline heals from serves at this quorum's step."""
        from torchft._torchft import ManagerClient

        result = self._client.last if self._client is not None else None
        if result is None:
            raise RuntimeError("no quorum result to heal from: torchft's client was not recorded")
        timeout = timedelta(seconds=self.settings.timeout)
        client = ManagerClient(
            result.recover_src_manager_address, connect_timeout=timedelta(seconds=self.settings.connect_timeout)
        )
        metadata = client._checkpoint_metadata(rank, timeout=timeout)
        full = self.manager._checkpoint_transport.recv_checkpoint(
            src_rank=result.recover_src_replica_rank, metadata=metadata, step=result.max_step, timeout=timeout
        )
        return full["user"]["default"]

    def _state_at_boundary(self) -> Any:
        """This rank's state for a joining peer, taken only at a step boundary (a prefetched quorum asks for it
        while the optimizer, the schedulers or the loops may still be moving)."""
        if not self._boundary.wait(timeout=self.settings.timeout):
            raise TimeoutError(f"no step boundary within {self.settings.timeout:.0f} s to hand this stage's state over")
        state = self._state_dict()
        return {**state, "layout": self.layout} if isinstance(state, dict) else state

    # ------------------------------------------------------------------ quorum
    def join(self, latest_step: int = 0, still_held: Callable[[], bool] | None = None) -> None:
        """The first quorum (at setup, before Lightning restores anything): a pipeline that is behind the others
        takes a peer's state here (``load_state_dict`` is called).

        ``latest_step``: the step the live pipelines held before this one joined. A quorum of this pipeline alone
        behind it (the others were still inside a step that lost a peer) would start the run over beside them:
        the quorum is asked for again until they are in it (and their state is taken), for up to
        ``quorum_timeout``, while they live (``still_held``, collective: a restart of every pipeline at once sees
        the killed ones on the lighthouse's page for a few seconds). A quorum with pipelines of another layout is
        refused (see ``running_quorum``)."""
        self._joining = True
        try:
            self._quorum()
            self._refuse_other_layouts()
            tries = max(1, int(self.settings.quorum_timeout / JOIN_RETRY_SECONDS))
            for _ in range(tries):
                if self._ranks_caught_up(latest_step) or self._holders_gone(still_held, latest_step):
                    break
                log.warning(
                    "lightning-spot: pipeline %s got a quorum at step %d while live pipelines hold step %d: "
                    "asking again, to take their state rather than start over",
                    self.settings.replica_group,
                    self.step,
                    latest_step,
                )
                time.sleep(JOIN_RETRY_SECONDS)
                # (checked again just before asking: a pipeline restarted beside this one may have seen them gone
                # meanwhile, resumed from its own memory and be in its first step: a quorum now would hand this one
                # that older state instead of the newer one its own memory may hold)
                if self._holders_gone(still_held, latest_step):
                    break
                self._quorum()
                self._refuse_other_layouts()
            else:
                self._stop_manager()
                raise QuorumError(
                    f"pipeline {self.settings.replica_group} got no quorum with the pipelines that held step "
                    f"{latest_step} when it joined, within {self.settings.quorum_timeout:.0f} s: it does not start "
                    f"the run over beside them. Restart it; if they are gone, it resumes from the durable checkpoints."
                )
        finally:
            self._joining = False
        self._unused_quorum = True
        log.warning(
            "lightning-spot: pipeline %s joined %d pipelines at step %d",
            self.settings.replica_group,
            self.participants,
            self.manager.current_step(),
        )

    def _ranks_caught_up(self, latest_step: int) -> bool:
        """(Collective over the pipeline) whether every rank took a peer's state or holds ``latest_step``. Ranks heal
        one by one: one whose source left mid-transfer has nothing while the others have their state, and a rank that
        went on to train would wait in the pipeline's first collective for one that asks the lighthouse again, with
        no timeout. So the ranks agree, and when they differ the pipeline leaves and rejoins whole."""
        mine = self.healed_state is not None or self.step >= latest_step
        if self.model is None:
            return mine
        every = all_gather_object(mine, group=self.model.group)
        if all(every) or not any(every):
            return bool(mine)
        self._leave_now(
            f"pipeline {self.settings.replica_group}: ranks {[r for r, ok in enumerate(every) if not ok]} took no "
            f"peer's state while the others did (a peer left during the transfer); it leaves and rejoins",
            PREEMPTED_EXIT_CODE,
        )
        return False

    def _holders_gone(self, still_held: Callable[[], bool] | None, latest_step: int) -> bool:
        """(Collective over the pipeline) whether the pipelines that held ``latest_step`` at the join stopped
        heartbeating (a restart of every pipeline: the killed ones linger a few seconds); said in the log."""
        if still_held is None or still_held():
            return False
        log.warning(
            "lightning-spot: pipeline %s: the pipelines that held step %d are gone; it joins at step %d",
            self.settings.replica_group,
            latest_step,
            self.step,
        )
        return True

    def _refuse_other_layouts(self) -> None:
        """Leave at once (no heartbeat that holds the others up) when the quorum holds pipelines of other layouts
        and this one took a peer's state: torchft heals stage ``k`` from stage ``k`` of a peer, which holds other
        layers under other cuts. Pipelines of other cuts that start together (nothing to heal) train together."""
        if self.healed_state is None and self.step == 0:
            return
        if isinstance(self.healed_state, dict) and self.healed_state.get("layout") == self.layout:
            return  # (healed, from its own layout or across: heal_across completed the state)
        result = self._client.last if self._client is not None else None
        ids = getattr(result, "replica_ids", None) or []
        refusal = layouts_refusal(layouts_in(ids), self.layout, str(self.settings.replica_group))
        if refusal is not None:
            self._stop_manager()
            raise LayoutError(refusal)

    def prefetch(self) -> None:
        """Ask for the next step's quorum now (a step has committed), so that the round trip to the lighthouse
        overlaps the rest of this step (the update, schedulers, callbacks, the next batch); the next
        :meth:`begin_step` waits for it. A peer that joins in it takes this rank's state only at that step
        boundary (:meth:`_state_at_boundary`), after the update."""
        if self._next_quorum is not None:
            return

        def ask() -> None:
            try:
                self.manager.start_quorum()
            except BaseException as err:  # (raised where it is waited for)
                self._next_quorum_error = err

        self._next_quorum_error = None
        self._next_quorum = threading.Thread(target=ask, name="lightning-spot-quorum", daemon=True)
        self._next_quorum.start()

    def _quorum(self, shrink_only: bool = False) -> None:
        """A new quorum (``shrink_only``: of pipelines in the last one only: no joiner, whose state would be taken
        in the middle of Lightning's accumulation window)."""
        started = time.monotonic()
        before = self.participants
        try:
            with self._span("quorum"):
                self._boundary.set()  # a peer that joins in this quorum may take this rank's state now
                try:
                    if self._next_quorum is None:
                        if shrink_only:
                            self.manager.start_quorum(shrink_only=True)
                        else:
                            self.manager.start_quorum()
                    else:
                        self._next_quorum.join()
                        if self._next_quorum_error is not None:
                            raise self._next_quorum_error
                finally:
                    self._boundary.clear()
                    self._next_quorum = None
        except Exception as err:  # the lighthouse is gone or unreachable: no pipeline can agree on a step
            through = (
                ""
                if self.manager_rank == 0
                else " through this pipeline's first rank, whose torchft manager asks it (that rank may be the one gone)"
            )
            raise LighthouseLostError(
                f"no quorum from the torchft lighthouse at {self.settings.lighthouse} within "
                f"{self.settings.quorum_timeout:.0f} s{through} ({type(err).__name__}: "
                f"{str(err).splitlines()[0][:200] if str(err) else ''}). Every rank exits with code {PEER_LOST_EXIT_CODE}: restart the lighthouse (`lightning-spot "
                f"coordinator` under a supervisor) and relaunch, and the pipelines resume from the durable checkpoints."
            ) from err
        quorum_id = self._quorum_id()
        members = self._members()
        if lighthouse_restarted(self._last_quorum, (quorum_id, members)):
            self._await_peers_after_restart(before)
        self._last_quorum = (self._quorum_id(), self._members())
        if self.healed_state is not None and not self._joining:
            self._fell_behind()
        rank = self.manager.participating_rank()
        self.participants = self.manager.num_participants()
        self.participant_rank = rank if rank is not None else 0
        if self.model is not None:
            self._use_mixed()
            if self._joining and self._mixed is not None and self.manager.errored() is not None:
                # (its heal failed: it does not train this step; the others' all-reduce with it fails now, not at
                # their timeout, and they ask for the next quorum, in which it heals again)
                self._mixed.abort()
        self.last_quorum_seconds = time.monotonic() - started
        if before and self.participants != before:
            self.quorum_changes += 1
            self._events.append(
                {
                    "kind": "quorum",
                    "step": self.manager.current_step(),
                    "pipelines": self.participants,
                    "was": before,
                    "quorum_seconds": round(self.last_quorum_seconds, 3),
                }
            )
            log.warning(
                "lightning-spot: %d pipelines train from step %d on (were %d)",
                self.participants,
                self.manager.current_step(),
                before,
            )

    def _await_peers_after_restart(self, before: int) -> None:
        """The lighthouse restarted (its quorum ids count from 1 again; ``lightning-spot coordinator`` under a
        supervisor): its first quorum holds the pipelines whose managers reached it first. One that trained in it
        would commit steps the others do not have, and they would restart to take its state; so while the quorum
        holds fewer pipelines than the last one (``before``), it is asked again, for up to
        :data:`LIGHTHOUSE_RESTART_WAIT_S` (a pipeline lost meanwhile costs the others that long)."""
        started = time.monotonic()
        log.warning(
            "lightning-spot: pipeline %s: the torchft lighthouse restarted; waiting up to %.0f s for the %d pipelines of "
            "the last quorum",
            self.settings.replica_group,
            LIGHTHOUSE_RESTART_WAIT_S,
            before,
        )
        while self.manager.num_participants() < before and time.monotonic() - started < LIGHTHOUSE_RESTART_WAIT_S:
            time.sleep(0.2)
            self._boundary.set()
            try:
                self.manager.start_quorum()
            finally:
                self._boundary.clear()
        self._events.append(
            {"kind": "lighthouse_restart", "step": self.manager.current_step(), "waited": time.monotonic() - started}
        )

    def overlap(
        self, params: Sequence[Tensor], tied: Sequence[Tensor], loss_weights: LossWeights, early: bool = True
    ) -> None:
        """The gradients to reduce: ``params``, in buckets; each goes to the other pipelines as soon as the backward
        has finished it (not ``tied`` copies, whose gradients are whole only after the step; none with
        ``early=False``: ``TorchFT(overlap=False)``, the default, or fp16); ``loss_weights``: what the losses are
        means over (the scale of an early bucket)."""
        self.buckets = EarlyBuckets(
            params,
            tied=tied,
            allreduce=lambda t: self.manager.allreduce(t, reduce_op=ReduceOp.SUM),
            during_backward=early,
            device=self.device,
        )
        self._loss_weights = loss_weights if early else None

    def _early_scale(self, rows: int, microbatches: int) -> float | None:
        """What an early bucket multiplies the sum of its micro-batch gradients by, so that it carries this
        pipeline's weight times its mean gradient: ``r x m`` (``r``, the reference count) when the losses are
        weighted by their items, ``rows`` when they are means over samples (each micro-batch's loss was divided by
        ``m``: early buckets are off with fp16, see ``StepRunner.divides_losses``); ``None`` until a step has
        shown which."""
        weights = self._loss_weights
        if weights is None or weights.items <= 0:  # no step settled yet in this process
            return None
        if weights.reference is not None:
            return weights.reference * microbatches
        return float(rows)

    def begin_step(
        self, batch: Any, microbatches: int, global_step: int, again: Callable[[], None] | None = None
    ) -> tuple[Any, int]:
        """Agree on this step's pipelines (a new quorum, unless the one of :meth:`join` is still unused, or an
        accumulation window is open) and return this replica's rows of the global ``batch`` with the global batch's
        size. ``again``: runs this batch again (the strategy's step on it), should its window not commit."""
        if self._first_step and self.step != global_step:  # resumed from a checkpoint: count from its step
            self.set_step(global_step)
            # (a new quorum, not the join's, where every pipeline was at step 0: pipelines that resumed from different
            # steps (each its own snapshots) must not train together; torchft hands those behind the newest state)
            self._unused_quorum = False
        self._first_step = False
        if self._window is None:
            if self._unused_quorum:
                self._unused_quorum = False
            else:
                self._quorum(shrink_only=self._window_again)
            self._window_again = False
            if self.accumulation() > 1:
                if self.keep is None:
                    raise RuntimeError("ReplicaGroup.keep (PipelineEngine.keep_step) is set at attach")
                self._window, self._window_undo = [], self.keep()
        if self._window is not None and again is not None:
            self._window.append(again)
        size = batch_size_of(batch)
        rows = participant_rows(size, microbatches, self.participant_rank, self.participants, self._speeds())
        self.rows = rows.stop - rows.start
        if self.buckets is not None:
            # (accumulating: every batch's gradients are rescaled after its schedule; nothing goes out early)
            early = self._window is None and self._mixed is None
            scale = self._early_scale(rows.stop - rows.start, microbatches) if early else None
            self.buckets.arm(microbatches, scale)
        return take_rows(batch, rows, size), size

    def _members(self) -> tuple[str, ...]:
        """The replica ids of the last quorum's pipelines."""
        result = self._client.last if self._client is not None else None
        return tuple(sorted(getattr(result, "replica_ids", None) or []))

    def _quorum_id(self) -> int | None:
        result = self._client.last if self._client is not None else None
        return getattr(result, "quorum_id", None)

    def _speeds(self) -> list[float] | None:
        """The speeds this step's shares follow: re-agreed every ``SHARES_EVERY`` commits (each pipeline's last stage
        sends what the last stages summed to the rest of its pipeline), valid in the quorum they were measured in."""
        if self.model is not None and self._window is not None and len(self._window) > 1:
            pass  # (inside an accumulation window: the shares of its first batch)
        elif self.model is not None and self.step % SHARES_EVERY == 0:
            plan = self.model.plan
            last = plan.rank_of_stage(plan.num_stages - 1)
            self.shares = broadcast_object(
                self._measured if self.manager_rank == last else None, self.model.group, last
            )
        if self.shares is None or self.shares[1] != self._quorum_id() or len(self.shares[0]) != self.participants:
            return None
        return self.shares[0]

    def _speed_vector(self, device: torch.device) -> Tensor | None:
        """(This pipeline's last stage) its speed at its place among the quorum's pipelines, zeros elsewhere."""
        if self.model is None or self.pace is None:
            return None
        plan = self.model.plan
        if self.manager_rank != plan.rank_of_stage(plan.num_stages - 1):
            return None
        seconds = self.pace()
        speeds = torch.zeros(self.participants, device=device)
        if seconds > 0 and self.rows > 0:
            speeds[self.participant_rank] = self.rows / seconds
        return speeds

    @torch.no_grad()
    def batch_done(self, weight: float) -> float:
        """After a batch's schedule: what its gradients are multiplied by as they enter ``.grad``. 1 without
        accumulation (the commit averages by ``weight``); in a window, ``P x weight / (the weights' sum over the
        quorum)``, so that the commit's plain sum over the ``P`` pipelines, divided by ``P``, is the whole batch's
        mean; the batch's logged sums ride in the same all-reduce and wait for the commit (``HeldLogs.park``)."""
        if self._window is None:
            return 1.0
        held = self.held_logs
        riders = held.riders() if held is not None else None
        parts = [torch.tensor([float(weight)], device=self.device)] + ([riders.flatten()] if riders is not None else [])
        flat = torch.cat(parts)
        with self._span("all-reduce"):
            try:
                if self._mixed is None:
                    self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
                else:  # (the weight over one rank of each pipeline, the logged sums over their last stages)
                    self._mixed.allreduce_small(flat[:1])
                    if riders is not None:
                        self._mixed.allreduce_small(flat[1:], riders=True)
                if held is not None and held.packed is not None:
                    held.packed.reduce_extremes(self._reduce_extremes)
            except Exception as err:  # (a peer lost: the window does not commit)
                self.manager.report_error(err)
        if riders is not None:
            riders.copy_(flat[1:].view_as(riders))
        if held is not None:
            held.park()
        total = float(flat[0])
        return self.participants * float(weight) / total if total > 0 else 0.0

    # ------------------------------------------------------------------ commit
    def reduce_and_commit(self, weight: float) -> bool:
        """Set every gradient to the weighted mean over the quorum's replicas (``weight``: what this replica's
        gradient is a mean over: samples, or items of a loss averaged over items); the vote of every rank of every
        pipeline decides whether the step counts."""
        if self.buckets is None:
            raise RuntimeError("ReplicaGroup.overlap() gives the gradients to reduce; it was not called")
        held = self.held_logs
        with self._span("all-reduce"):  # (the buckets that went out during the backward are waited for here)
            # the step's logged sums ride with the gradients (the last stage's; the others have none), and so does
            # each pipeline's speed (the batch shares follow them)
            riders = held.riders() if held is not None else None
            speeds = self._speed_vector(self.device)
            carried = (
                speeds
                if riders is None
                else (riders.flatten() if speeds is None else torch.cat([riders.flatten(), speeds]))
            )
            if self._mixed is None:
                self.buckets.reduce(weight, carried)
            else:  # (pipelines of other cuts: each parameter among its holders)
                try:
                    self._mixed.reduce(weight, carried)
                except Exception as err:  # (a peer lost: the step does not commit)
                    self.manager.report_error(err)
            if carried is not None and riders is not None:
                riders.copy_(carried[: riders.numel()].view_as(riders))
            if held is not None and held.packed is not None:
                held.packed.reduce_extremes(self._reduce_extremes)
        with self._span("commit"):
            committed = bool(self.manager.should_commit())
        if committed and speeds is not None and carried is not None:  # (what every last stage summed alike)
            quorum = self._quorum_id()
            measured = carried[carried.numel() - speeds.numel() :].tolist()
            self._measured = (measured, quorum) if quorum is not None else None
        return committed

    def _reduce_extremes(self, t: Tensor, op: Any) -> None:
        """The logged values' largest and smallest over the quorum (the last stages)."""
        if self._mixed is None:
            self.manager.allreduce(t, reduce_op=op).wait()
            return
        try:
            self._mixed.allreduce_small(t, op, riders=True)
        except Exception as err:  # (a peer lost: the step does not commit)
            self.manager.report_error(err)

    @contextlib.contextmanager
    def _span(self, name: str) -> Iterator[None]:
        """Time ``name`` (and trace it on the timeline's torchft lane when one records)."""
        started = time.perf_counter()
        try:
            with (
                self.clock.span(name, "torchft", lane="torchft") if self.clock is not None else contextlib.nullcontext()
            ):
                yield
        finally:
            self.seconds[name] += time.perf_counter() - started

    def committed(
        self, closure: Callable[[], Any], weight: Callable[[], float], keep: Callable[[], Callable[[], None]]
    ) -> Callable[[], Any]:
        """``closure`` (the step's forward and backward) run until its gradients commit, its logged values
        replayed then; a step that does not commit leaves nothing behind (``keep()``, called before it, returns
        what undoes it) and is run again with the quorum that follows."""

        def run() -> Any:
            again: list[Callable[[], None]] = []
            while True:
                for batch in again:  # (a window run again: its earlier batches, which open it with a new quorum)
                    batch()
                undo = self._window_undo if self._window_undo is not None else keep()
                result = closure()
                # (in a window each batch's gradients are its part of the quorum's mean already: a plain sum)
                if self.reduce_and_commit(1.0 if self._window is not None else weight()):
                    self._window = self._window_undo = None
                    self.prefetch()  # the next quorum's round trip overlaps the update
                    if self.held_logs is not None:
                        self.held_logs.replay()
                    return result
                self.discarded += 1
                again = (self._window or [])[:-1]  # (the last batch is Lightning's closure)
                self._window = self._window_undo = None
                self._window_again = bool(again)
                undo()
                self._events.append({"kind": "step_run_again", "step": self.manager.current_step()})
                self._pg.abort()  # peers still inside this step's all-reduce with us fail now, not at a timeout
                if self._mixed is not None:
                    self._mixed.abort()
                    self._mixed, self._mixed_quorum = None, -1
                for p in self.buckets.params if self.buckets is not None else ():
                    p.grad = None
                log.warning(
                    "lightning-spot: step %d did not commit on every pipeline (a peer left); running it again",
                    self.manager.current_step(),
                )

        return run

    def take_events(self) -> list[dict[str, Any]]:
        """Quorum changes and steps run again since the last call (for the run history)."""
        events, self._events = self._events, []
        return events

    def _fell_behind(self) -> None:
        """The others committed a step this pipeline did not (it was still waiting for a peer that had left): its
        weights could be caught up, but not Lightning's loop position, so it leaves and rejoins at setup, where a
        peer's state is restored with the loop (its torchrun restarts it; the others go on)."""
        self._leave_now(
            f"pipeline {self.settings.replica_group} fell behind the others (step {self.manager.current_step()}); it "
            f"leaves and rejoins",
            PREEMPTED_EXIT_CODE,
        )

    def _leave_now(self, line: str, code: int) -> None:
        """Say ``line``, stop heartbeating (the others' quorum does not wait for this pipeline) and exit with
        ``code`` at once, whatever the main thread waits for (the agent starts the pipeline again)."""
        print(f"lightning-spot: {line}", file=sys.stderr, flush=True)
        self._stop_manager()
        os._exit(code)

    @property
    def step(self) -> int:
        """Steps committed (torchft's count)."""
        return int(self.manager.current_step())

    def set_step(self, step: int) -> None:
        """After a resume from a checkpoint: count commits from its step on."""
        self.manager.load_state_dict({"step": step, "batches_committed": self.manager.batches_committed()})

    def _stop_manager(self) -> None:
        self.manager.shutdown(wait=False)

    def leave_broken(self, peer: int, why: str) -> None:
        """(``PeerExits``' thread, on the first rank) rank ``peer`` of this pipeline exited: stop heartbeating now, so
        that the other pipelines' next quorum does not wait for this one, and exit as for a lost peer (its agent
        starts the pipeline again on the nodes it has)."""
        self._leave_now(
            f"pipeline {self.settings.replica_group}: rank {peer} exited ({why}); this pipeline leaves the quorum at "
            f"once and its agent starts it again",
            PEER_LOST_EXIT_CODE,
        )

    def shutdown(self) -> None:
        """Stop heartbeating (a pipeline that leaves must not hold up the others' quorum); from the main thread."""
        if self.peer_exits is not None:
            self.peer_exits.close()
        self._leave.stop()
        self._stop_manager()
