"""``torch.distributed`` helpers that also work in a single process (no process group).

if is_initialized(): ...
rank(group), world_size(group)                # 0 and 1 without a process group
value = broadcast_object(value, group)         # the first rank's value everywhere
values = all_gather_object(value, group)       # every rank's value, on every rank
values = gather_object_to_first(value, group)  # every rank's value on the first rank, None elsewhere
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def is_initialized() -> bool:
    """Whether a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (the default group if ``None``); 0 without a process group."""
    return dist.get_rank(group) if is_initialized() else 0


def world_size(group: dist.ProcessGroup | None = None) -> int:
    """The size of ``group`` (the default group if ``None``); 1 without a process group."""
    return dist.get_world_size(group) if is_initialized() else 1


def broadcast_object(obj: Any, group: dist.ProcessGroup | None = None, group_src: int = 0) -> Any:
    """``obj`` as the rank ``group_src`` of ``group`` has it, on every rank of ``group``."""
    if world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group=group, group_src=group_src)
    return box[0]


def all_gather_object(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank of ``group``."""
    if world_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_object_to_first(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any] | None:
    """Every rank's ``obj`` on the first rank of ``group`` (``None`` on the others)."""
    if world_size(group) == 1:
        return [obj]
    out: list[Any] | None = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
    dist.gather_object(obj, out, group=group, group_dst=0)
    return out
