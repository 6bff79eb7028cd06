"""Keep plans stable: measurements reused, and the previous plan kept unless a new one is clearly better.

    hardware = reuse_or_measure(device, base, cache_dir)            # collective; once per set of machines
    memory = PlanMemory([PlanPlace("s3://bucket/run/plans", opts), PlanPlace("~/.cache/.../plans")])
    previous = memory.recall(key)                                    # the plan chosen last time, or None
    chosen, reason = keep_or_switch(best, previous_now, margin=PLAN_MARGIN)
    memory.remember(key, chosen)

The same command on the same machines then gets the same plan: layer profiles and hardware
measurements come from the cache, and a plan is only replaced when the new one is predicted at
least ``PLAN_MARGIN`` faster than the previous one re-evaluated now. After an elastic restart the
previous plan (pipeline depth, micro-batches, schedule, recomputation, cuts) is re-evaluated on the
new world and kept while it still fits and is within the margin. The run directory of
``SpotCheckpoint`` is one of the places, so the plan follows the job to other machines.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import fsspec
import torch
from torch import nn

from lightning_spot.planning.cost_model import Candidate
from lightning_spot.planning.hardware import Hardware, measure_hardware
from lightning_spot.utils.distributed import all_gather_object, broadcast_object, rank

log = logging.getLogger(__name__)

#: a new plan replaces the previous one only when predicted at least this much faster (10%: the
#: planner's typical prediction error on the benchmark machines, see docs/planner.md)
PLAN_MARGIN = 0.10

#: the fields of :class:`Hardware` that are measured (the rest come from the device and the settings)
_MEASURED = (
    "optimizer_bytes_per_s",
    "host_optimizer_bytes_per_s",
    "p2p_latency_s",
    "p2p_bytes_per_s",
    "allreduce_latency_s",
    "allreduce_bytes_per_s",
)


def _digest(*parts: Any) -> str:
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:16]


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


# ------------------------------------------------------------------------------------------- hardware
def world_hosts(device: torch.device) -> list[Any]:
    """Every rank's host name, device and CPU threads, in rank order (collective): what a measurement or a
    plan was made for."""
    return all_gather_object((socket.gethostname(), _device_name(device), torch.get_num_threads()))


def reuse_or_measure(
    device: torch.device, base: Hardware, cache_dir: Path | None, hosts: list[Any] | None = None
) -> tuple[Hardware, bool]:
    """``measure_hardware``, or its result from an earlier start on the same machines (collective).

    The key holds every rank's host name and device, the world size and the CPU threads (``hosts``, from
    :func:`world_hosts`), so a cached measurement is only reused where it was taken. Returns the hardware and
    whether it was reused.
    """
    hosts = world_hosts(device) if hosts is None else hosts
    path = cache_dir / f"hardware-{_digest(hosts, torch.__version__)}.json" if cache_dir is not None else None
    cached = None
    if rank() == 0 and path is not None and path.is_file():
        try:
            cached = {k: float(v) for k, v in json.loads(path.read_text()).items() if k in _MEASURED}
        except (OSError, ValueError) as err:
            log.warning("lightning-spot: ignoring unreadable hardware measurement %s: %s", path, err)
    cached = broadcast_object(cached)
    if cached is not None and len(cached) == len(_MEASURED):
        return replace(base, **cached), True
    measured = measure_hardware(device, base)
    if rank() == 0 and path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({k: getattr(measured, k) for k in _MEASURED}))
        except OSError as err:
            log.warning("lightning-spot: could not cache the hardware measurement in %s: %s", path, err)
    return measured, False


# ---------------------------------------------------------------------------------------------- plans
def plan_key(module: nn.Module, layers_path: str, device: torch.device, global_batch: int, requested: Any) -> str:
    """What makes two start-ups the same planning problem: the model's structure, the device kind, the
    global batch and the user's settings (not the world size: a restart on another world keeps its plan)."""
    shapes = [(n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters()]
    return _digest(type(module).__qualname__, shapes, layers_path, _device_name(device), global_batch, repr(requested))


@dataclass(frozen=True)
class PlanPlace:
    """A directory (any fsspec URL) where plans are remembered."""

    url: str
    storage_options: dict[str, Any] | None = None

    def _path(self, name: str) -> tuple[Any, str]:
        fs, root = fsspec.core.url_to_fs(self.url, **(self.storage_options or {}))
        return fs, f"{root.rstrip('/')}/{name}.json"


class PlanMemory:
    """The plan chosen at the last start-up, read from the first place that has it and written to all."""

    def __init__(self, places: Sequence[PlanPlace]) -> None:
        self.places = list(places)

    def recall(self, key: str) -> Candidate | None:
        data = self.read(f"plan-{key}")
        return Candidate(**{f.name: data[f.name] for f in fields(Candidate) if f.name in data}) if data else None

    def remember(self, key: str, plan: Candidate) -> None:
        self.write(f"plan-{key}", asdict(plan))

    def read(self, name: str) -> dict[str, Any] | None:
        """The JSON object ``name`` from the first place that has it."""
        for place in self.places:
            try:
                fs, path = place._path(name)
                if fs.exists(path):
                    return json.loads(fs.cat_file(path))
            except Exception as err:
                log.warning("lightning-spot: could not read the previous plan from %s: %s", place.url, err)
        return None

    def write(self, name: str, data: dict[str, Any]) -> None:
        """``data`` as the JSON object ``name`` in every place."""
        for place in self.places:
            try:
                fs, path = place._path(name)
                fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
                fs.pipe_file(path, json.dumps(data).encode())
            except Exception as err:
                log.warning("lightning-spot: could not remember the plan in %s: %s", place.url, err)


def decision_name(key: str, hosts: list[Any]) -> str:
    """Where the whole decision for this model and batch on exactly these processes is remembered."""
    return f"decision-{key}-{_digest(hosts, torch.__version__)}"


def same_plan(a: Candidate, b: Candidate) -> bool:
    """Whether two candidates build the same pipeline (data-parallel width aside)."""
    return (a.pipeline_stages, a.microbatches, a.schedule, a.activation_checkpointing, list(a.cuts), a.offload) == (
        b.pipeline_stages,
        b.microbatches,
        b.schedule,
        b.activation_checkpointing,
        list(b.cuts),
        b.offload,
    )


def keep_or_switch(
    best: Candidate, previous: Candidate | None, previous_now: Candidate | None, margin: float = PLAN_MARGIN
) -> tuple[Candidate, str]:
    """Choose between the planner's ``best`` and the previous plan, re-evaluated now (``previous_now``:
    ``None`` when it does not fit this world). Returns the plan and why, for the log."""
    if previous is None:
        return best, "no earlier plan for this model and batch"
    if previous_now is None:
        return best, f"plan changed: the previous plan ({previous.layout}) does not fit this world"
    if same_plan(best, previous_now):
        return best, "the same plan as before"
    gain = 1.0 - best.predicted_step_seconds / previous_now.predicted_step_seconds
    if gain > margin:
        return best, (
            f"plan changed from {previous_now.layout} to {best.layout}: predicted {100 * gain:.0f}% faster "
            f"({1000 * previous_now.predicted_step_seconds:.1f} -> {1000 * best.predicted_step_seconds:.1f} ms/step), "
            f"more than the {100 * margin:.0f}% margin"
        )
    return previous_now, (
        f"kept the previous plan {previous_now.layout} ({1000 * previous_now.predicted_step_seconds:.1f} ms/step): "
        f"the best alternative, {best.layout} ({1000 * best.predicted_step_seconds:.1f} ms/step), is not "
        f"{100 * margin:.0f}% faster"
    )
