"""``torch.distributed`` helpers that also work in a single process (no process group).

if is_initialized(): ...
rank(group), world_size(group)                # 0 and 1 without a process group
value = broadcast_object(value, group)         # the first rank's value everywhere
values = all_gather_object(value, group)       # every rank's value, on every rank
values = gather_object_to_first(value, group)  # every rank's value on the first rank, None elsewhere
received = exchange_bytes([(to, tag, data)], [(src, tag)], group)  # point to point
"""

from __future__ import annotations

from typing import Any

import torch
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


def exchange_bytes(
    sends: list[tuple[int, int, bytes]], receives: list[tuple[int, int]], group: dist.ProcessGroup | None = None
) -> list[bytes]:
    """Point to point: send each ``(to rank, tag, data)`` and receive one message per ``(from rank, tag)``.

    Ranks are ranks of ``group``; a tag tells apart several messages between the same two ranks. Every
    send must have its receive on the other side (sizes go first, then the bytes); gloo on any device.
    """
    if not sends and not receives:
        return []

    def peer(r: int) -> int:
        return dist.get_global_rank(group, r) if group is not None else r

    def run(out: list[torch.Tensor], into: list[torch.Tensor], offset: int) -> None:
        works = [dist.isend(t, peer(to), group=group, tag=2 * tag + offset) for t, (to, tag, _) in zip(out, sends)]
        works += [dist.irecv(t, peer(src), group=group, tag=2 * tag + offset) for t, (src, tag) in zip(into, receives)]
        for work in works:
            if work is not None:
                work.wait()

    sizes = [torch.zeros(1, dtype=torch.int64) for _ in receives]
    run([torch.tensor([len(data)], dtype=torch.int64) for _, _, data in sends], sizes, 0)
    received = [torch.empty(int(size.item()), dtype=torch.uint8) for size in sizes]
    run([torch.frombuffer(bytearray(data), dtype=torch.uint8) for _, _, data in sends], received, 1)
    return [t.numpy().tobytes() for t in received]
