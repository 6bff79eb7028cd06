"""Whether a pipeline's stages hold their training state in device memory, checked before it joins the quorum.

    short = memory_shortfall(engine, device_memory=None, offloaded=())   # None: every stage fits
    if short is not None:
        wait_for_nodes(short) if others_train else refuse(short)

torchft's pipelines choose their cuts alone, by the simple rules (no measurement: every pipeline must cut alike),
so nothing has checked them against the device's memory; a pipeline that re-forms on the nodes a loss left it
(depth 1 after losing one of two) may not hold the model at all. Here each rank counts its own stages' training
state (weights; for what trains also its gradients and Adam's two moments, or only the gradients when
``offload="optimizer"`` keeps the rest in host memory) and the pipeline's first rank compares the largest with the
device memory (``device_memory``, or what the device reports). Activations come on top and are not counted.

Survivors that cannot hold the model wait, outside the quorum, for their nodes to return: torchrun's agent
(``--nnodes MIN:MAX``) starts them again, deeper, as soon as a node joins their rendezvous. When the pipelines share
a coordinator's store, they merge with another broken pipeline's survivors meanwhile (``merge``).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from types import FrameType
from typing import TYPE_CHECKING, NoReturn

import torch

from lightning_spot.planning.hardware import Hardware, default_hardware
from lightning_spot.preemption import PREEMPTED_EXIT_CODE
from lightning_spot.preemption.signals import SIGNALS
from lightning_spot.utils.distributed import all_gather_object, broadcast_object
from lightning_spot.utils.units import format_bytes
from lightning_spot_launch import MOVED_EXIT_CODE
from lightning_spot_launch.moves import write_move

if TYPE_CHECKING:
    from lightning_spot.runtime.engine import PipelineEngine
    from lightning_spot.torchft.merge import SurvivorMerge

#: training state per byte of a trained parameter: weights, gradients, Adam's two moments (``Hardware``'s default)
STATE_FACTOR = Hardware().state_factor
#: the same with ``offload="optimizer"``: weights and gradients on the device, the rest in host memory
OFFLOADED_STATE_FACTOR = 2.0
#: how often a waiting pipeline looks for survivors to merge with (and heartbeats its own wait)
MERGE_TICK_SECONDS = 1.0


def training_state_bytes(module: torch.nn.Module, offloaded: tuple[str, ...] = ()) -> int:
    """Device bytes of ``module``'s training state: frozen weights once, trained ones with their gradients and
    optimizer state (see the module's text)."""
    factor = OFFLOADED_STATE_FACTOR if "optimizer" in offloaded else STATE_FACTOR
    total = 0.0
    for p in module.parameters():
        nbytes = p.numel() * p.element_size()
        total += nbytes * factor if p.requires_grad else nbytes
    return int(total)


def device_capacity(device: torch.device, device_memory: float | None) -> float | None:
    """Memory per device for training state: ``device_memory`` when given, else what the device reports (90% of a
    GPU's; a CPU process's share of the host's available memory); ``None``: unknown."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return default_hardware(device, device_memory, local).memory_bytes


def shortfall_message(needs: list[int], capacity: float, stages: int, cuts: list[int]) -> str | None:
    """Why a pipeline whose ranks need ``needs`` bytes does not fit ``capacity`` per device (``None``: it fits)."""
    worst = max(range(len(needs)), key=lambda r: needs[r])
    if needs[worst] <= capacity:
        return None
    at = f" cut at layers {cuts}" if cuts else ""
    return (
        f"at depth {stages}{at}, rank {worst} of this pipeline needs {format_bytes(needs[worst])} for its training "
        f"state (weights, gradients, optimizer state; activations on top), more than the "
        f"{format_bytes(capacity)} per device"
    )


def memory_shortfall(engine: PipelineEngine, device_memory: float | None, offloaded: tuple[str, ...]) -> str | None:
    """Collective over the pipeline: why its stages do not fit their devices, the same on every rank (``None``:
    they fit, or the device's memory is unknown)."""
    need = training_state_bytes(engine.module, offloaded)
    needs = all_gather_object(need, group=engine.ctx.pp_group)
    verdict = None
    if engine.ctx.pp_rank == 0:
        capacity = device_capacity(engine.ctx.device, device_memory)
        if capacity is not None:
            verdict = shortfall_message(needs, capacity, engine.plan.pp_size, engine.plan.cuts)
    return broadcast_object(verdict, group=engine.ctx.pp_group)


def wait_for_nodes(why: str, who: str, *, first_rank: bool, merge: SurvivorMerge | None = None) -> NoReturn:
    """Stay out of the quorum until torchrun's agent stops this process (a node joined the pipeline's rendezvous:
    it starts the pipeline again, deeper) or a notice arrives; exits with the preemption code then. With ``merge``
    (the pipelines share a coordinator's store), join another waiting pipeline's survivors when together they are
    enough nodes: exit with ``MOVED_EXIT_CODE``, the agent joining that pipeline's rendezvous."""
    if first_rank:
        how = (
            "or it joins another pipeline's survivors that wait too, when together they are enough nodes"
            if merge is not None
            else "(survivors of two broken pipelines merge only when the pipelines share a coordinator: "
            "`lightning-spot run --coordinator`)"
        )
        print(
            f"lightning-spot: {who} waits for its nodes to return: {why}. It does not join the quorum; the other "
            f"pipelines train on. When a node joins this pipeline's rendezvous (`--nnodes MIN:MAX`), torchrun's agent "
            f"starts it again at the larger depth and it takes a live pipeline's state; {how}.",
            file=sys.stderr,
            flush=True,
        )

    def leave(signum: int, frame: FrameType | None) -> None:
        os._exit(PREEMPTED_EXIT_CODE)  # (nothing to save: the live pipelines hold the state)

    for signum in (signal.SIGTERM, signal.SIGINT):  # the agent's restart, or a notice
        SIGNALS.add(signum, "torchft_wait", leave)
    while True:
        target = merge.tick(decide_here=first_rank) if merge is not None else None
        if target is not None:
            if first_rank:
                print(
                    f"lightning-spot: {who} joins pipeline {target.group}, whose survivors wait too: its nodes leave "
                    f"for that pipeline's rendezvous",
                    file=sys.stderr,
                    flush=True,
                )
            write_move(target)
            os._exit(MOVED_EXIT_CODE)
        time.sleep(MERGE_TICK_SECONDS if merge is not None else 3600)
