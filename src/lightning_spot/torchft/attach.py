"""Put a pipeline into its replica group at setup, and restore a peer's state through Lightning's resume path.

group = attach(trainer, engine, settings, group_size=P)   # end of the strategy's setup when fitting
checkpoint, record = healed_checkpoint(group, module, optimizers, engine)   # its load_checkpoint(HEAL_URL)
"""

from __future__ import annotations

import gc
import time
import uuid
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_spot.checkpoint.payload import Payload
from lightning_spot.checkpoint.resume import ResumeOverride
from lightning_spot.layout import Layout, LayoutError
from lightning_spot.runtime.engine import PipelineEngine
from lightning_spot.runtime.offload import OptimizerOffload
from lightning_spot.torchft.config import TorchFT
from lightning_spot.torchft.heal import HEAL_URL, apply_stage_state, stage_state
from lightning_spot.torchft.merge import SurvivorMerge
from lightning_spot.torchft.peer_exits import PeerExits
from lightning_spot.torchft.replica_group import ReplicaGroup, StageModel
from lightning_spot.torchft.running_quorum import layout_tag, read_running
from lightning_spot.torchft.stage_memory import memory_shortfall, wait_for_nodes
from lightning_spot.utils.distributed import broadcast_object

__all__ = ["HEAL_URL", "ReplicaGroup", "attach", "check_fits", "healed_checkpoint"]

if TYPE_CHECKING:
    import lightning.pytorch as pl


def check_fits(grid: Layout, trainer: pl.Trainer, offloaded: tuple[str, ...] = ()) -> None:
    """What the torchft mode does not run (yet), named with the alternative."""
    if grid.data_parallel != 1:
        raise LayoutError(
            f"fault_tolerance='torchft' makes each pipeline a replica group of its own: start one torchrun per "
            f"pipeline (WORLD_SIZE = its depth) and let the lighthouse join them; this process group of "
            f"{grid.world_size} ranks holds {grid} (`lightning-spot run --replica-groups N` starts them for you)"
        )
    if "parameters" in offloaded:
        raise LayoutError(
            "fault_tolerance='torchft' with offload='parameters' (weights streamed from host memory) is not supported "
            "yet: use offload='optimizer' (fp32 masters and optimizer state in host memory), or more pipeline stages"
        )


def attach(
    trainer: pl.Trainer,
    engine: PipelineEngine,
    settings: TorchFT,
    *,
    group_size: int,
    offloaded: tuple[str, ...] = (),
    offload: OptimizerOffload | None = None,
    device_memory: float | None = None,
) -> ReplicaGroup:
    """The pipeline's replica group after its first quorum; a joiner's state is restored as a checkpoint.
    ``offloaded``: the run's offload levels; ``offload``: the host masters of ``offload="optimizer"`` (a peer
    is handed those, not the device copies); ``device_memory``: per device, for the check of its stages (default:
    what the device reports). A pipeline whose stages do not fit waits for its nodes while others train, else fails."""
    check_fits(engine.layout.grid, trainer, offloaded)

    def state() -> dict[str, Any]:
        # (with the optimizer offloaded: the fp32 masters and the host optimizer state, which the update reads)
        with offload.on_host(list(trainer.strategy.optimizers)) if offload is not None else nullcontext():
            return {"stage": stage_state(trainer), "samples_seen": engine.samples_seen}

    settings = settings.resolved()
    plan = engine.plan
    layout = layout_tag(plan.num_stages, plan.cuts, plan.pp_size, plan.style)
    latest, holders = _check_running_quorum(settings, engine)
    _check_memory(settings, engine, device_memory, offloaded, others_train=latest > 0)
    group = ReplicaGroup(
        settings,
        group_rank=engine.ctx.pp_rank,
        group_size=group_size,
        state_dict=state,
        clock=engine.clock,
        layout=layout,
        device=engine.ctx.device,
    )
    # fp16: the gradients seen during the backward carry the loss scale; they all go out after the step then
    early = settings.overlap and engine.runner.scaler is None
    group.overlap(engine.params, engine.ties.copies, engine.runner.loss_weights, early=early)
    # (what pipelines of other cuts in the quorum need to find each parameter's holders)
    group.model = StageModel(engine.module, engine.split, engine.plan, engine.ctx.pp_group, engine.ties.tied)
    group.pace = lambda: engine.last_step_seconds  # (its schedule's seconds: the pipeline's speed on its last stage)
    group.peer_exits = PeerExits.start(engine.ctx.pp_rank, group_size, group.leave_broken)
    _settle_heap()
    group.join(latest_step=latest, still_held=lambda: _still_live(settings, holders, engine))
    group.held_logs = engine.held_logs  # (the engine holds the step's logged values until the commit)
    group.accumulation = lambda: int(trainer.accumulate_grad_batches)  # (a callback may change it per epoch)
    group.keep = engine.keep_step
    if group.healed_state is not None:
        _resume_from_peer(trainer)
    return group


def _check_running_quorum(settings: TorchFT, engine: PipelineEngine) -> tuple[int, list[str]]:
    """Before this pipeline joins: the latest step the live pipelines hold and their replica ids, on every one of its
    ranks (read once, on its first rank, from the lighthouse's page; a joiner of any depth and cuts heals from a live
    pipeline's ranks: ``heal_across``)."""
    found: tuple[int, list[str]] = (0, [])  # (no page to read: the quorum's own replica ids are checked at the join)
    if engine.ctx.pp_rank == 0:
        assert settings.lighthouse is not None and settings.replica_group is not None
        running = read_running(settings.lighthouse, timeout=settings.connect_timeout)
        if running is not None:
            found = (running.latest_step(settings.replica_group), running.holders(settings.replica_group))
    latest, holders = broadcast_object(found, group=engine.ctx.pp_group)
    return int(latest), list(holders)


def _still_live(settings: TorchFT, holders: list[str], engine: PipelineEngine) -> bool:
    """(Collective over the pipeline) whether a pipeline that held the latest step when this one came still
    heartbeats; those killed with it (a restart of every pipeline) stop within seconds."""
    alive = None
    if engine.ctx.pp_rank == 0:
        assert settings.lighthouse is not None
        running = read_running(settings.lighthouse, timeout=settings.connect_timeout)
        alive = running is None or running.any_live(holders)
    return bool(broadcast_object(alive, group=engine.ctx.pp_group))


def _check_memory(
    settings: TorchFT,
    engine: PipelineEngine,
    device_memory: float | None,
    offloaded: tuple[str, ...],
    others_train: bool,
) -> None:
    """Stages that cannot hold their training state: wait for the nodes to return while other pipelines train (a
    pipeline re-formed on too few nodes; or merge with another's survivors, ``merge``), else fail with the fix."""
    short = memory_shortfall(engine, device_memory, offloaded)
    if short is None:
        return
    who = f"pipeline {settings.replica_group}"
    if others_train:
        token = broadcast_object(uuid.uuid4().hex if engine.ctx.pp_rank == 0 else None, group=engine.ctx.pp_group)
        merge = SurvivorMerge.from_env(str(settings.replica_group), str(token))
        wait_for_nodes(short, who, first_rank=engine.ctx.pp_rank == 0, merge=merge)
    raise LayoutError(
        f"{who} does not fit its devices: {short}. Give it more nodes or processes (deeper stages hold less), "
        f"offload='optimizer', or set device_memory= if the devices hold more than reported."
    )


def _settle_heap() -> None:
    """Collect once and freeze what setup left on the heap (``gc.freeze``), before the first quorum.

    A joiner's first step otherwise ran Python's first full collection over the ~400k objects that imports and
    setup leave (0.16-0.23 s, seen inside Lightning's first ``self.log``), while the other pipelines waited for it
    in the all-reduce: the survivors' stall for a join of 192 MiB went from 0.41-0.75 s to 0.24-0.54 s (median
    0.60 -> 0.26 s, ``benchmarks/ft_recovery.py --kills 1 --width 2048``, 4 runs each). Later collections leave
    the frozen objects alone; garbage is collected first, so nothing that was garbage is kept.
    """
    gc.collect()
    gc.freeze()


def _resume_from_peer(trainer: pl.Trainer) -> None:
    """Make Lightning's resume (right after setup) load the healed state, whatever ``ckpt_path`` says."""
    ResumeOverride.of(trainer).add("torchft_heal", lambda _asked: HEAL_URL, first=True, once=True)


def healed_checkpoint(
    group: ReplicaGroup,
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    engine: PipelineEngine,
    offload: OptimizerOffload | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(Lightning checkpoint, manifest-like record) of the state a peer sent at :func:`attach` (``offload``: into
    the host masters and host optimizer state of ``offload="optimizer"``)."""
    started = time.monotonic()
    state, group.healed_state = group.healed_state, None
    if state is None:
        raise RuntimeError(f"{HEAL_URL} is restored once, after a pipeline joined and took a peer's state")
    with offload.on_host(optimizers) if offload is not None else nullcontext():
        checkpoint = apply_stage_state(module, optimizers, engine.ties.aliases, state["stage"])
    engine.restore_position(int(state["samples_seen"]))
    record = {
        "step": int(checkpoint.get("global_step", 0)),
        "tier": "peer",
        "bytes": Payload(**state["stage"]).nbytes,
        "restore_seconds": time.monotonic() - started,
        #: the joining quorum, the transfer of the peer's state included (an upper bound of the transfer)
        "join_seconds": group.last_quorum_seconds,
    }
    return checkpoint, record
