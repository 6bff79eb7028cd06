"""Only a pipeline's first stage reads a stream; the other stages receive each batch from it.

    loader = stage_feed(stream_loader, pp_group, reads=pp_rank == 0)

Every stage of a replica needs the batch (a stage replays the training step up to its layers: masks, positions
and targets come from the batch), but only the first stage reads storage: after each batch it broadcasts the batch
and what its loader's state is made of (:meth:`mirror`) over the pipeline's process group, so a checkpoint taken on
any stage holds the same position. The others build no reader and open nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from lightning_spot.utils.distributed import broadcast_object

_END = "lightning-spot: end of pass"


class StageFeed:
    """A stream loader (global stream, sharded, fixed layout) read on the first stage, received on the others."""

    def __init__(self, loader: Any, group: dist.ProcessGroup, reads: bool) -> None:
        self.loader, self.group, self.reads = loader, group, reads

    def __iter__(self) -> Iterator[Any]:
        if self.reads:
            for batch in self.loader:
                broadcast_object((batch, self.loader.mirror()), self.group)
                yield batch
            broadcast_object((_END, self.loader.mirror()), self.group)
            return
        fresh = True
        while True:
            batch, fields = broadcast_object(None, self.group)
            self.loader.take_mirror(fields, fresh)
            fresh = False
            if isinstance(batch, str) and batch == _END:
                return
            yield batch

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def sampler(self) -> Any:
        return self.loader.sampler if self.reads else None

    @property
    def batch_size(self) -> Any:
        return self.loader.batch_size

    def close(self) -> None:
        self.loader.close()

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


def stage_feed(loader: Any, group: dist.ProcessGroup | None, reads: bool) -> Any:
    """``loader`` read on the first stage (``reads``) and received on the other stages of ``group`` (a pipeline's
    ranks, the first stage first); ``loader`` itself without a pipeline group."""
    if group is None or dist.get_world_size(group) == 1:
        return loader
    return StageFeed(loader, group, reads)
