"""The job's failure board: the first rank to fail writes what failed into the process group's key-value
store; every rank can read it.

    board = FailureBoard.for_job()                # None without a process group
    first = board.publish(Failure(rank, "ValueError: boom", "training step 57"))   # the first one wins
    board.read()                                  # the first failure, or None
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import asdict, dataclass

import torch.distributed as dist

log = logging.getLogger(__name__)

#: one board per fit (every rank runs the same fits in the same order, so the numbers agree)
_generation = 0
_generation_lock = threading.Lock()


@dataclass(frozen=True)
class Failure:
    """What failed first: on which rank, the error in one line, where (optional), and whether it was a peer that
    was lost (killed, frozen, its node gone) rather than an error of the job's code."""

    rank: int
    error: str
    where: str = ""
    peer: bool = False

    def describe(self) -> str:
        return f"rank {self.rank} failed{' in ' + self.where if self.where else ''}: {self.error}"


class FailureBoard:
    """A key in the job's store that holds the first failure (``compare_set``: later ones lose)."""

    def __init__(self, store: dist.Store, key: str) -> None:
        self.store = store
        self.key = key

    @classmethod
    def for_job(cls) -> FailureBoard | None:
        """The board of this fit, in the default process group's store (``None`` without one)."""
        global _generation
        if not (dist.is_available() and dist.is_initialized()):
            return None
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception as err:  # an init method without a store
            log.debug("lightning-spot: no store for the failure board: %s", err)
            return None
        with _generation_lock:
            _generation += 1
            generation = _generation
        return cls(store, f"lightning_spot/failure/{generation}")

    def publish(self, failure: Failure) -> Failure | None:
        """Write ``failure`` unless a failure is there already; return the one that is there (``None``: the store
        cannot be reached)."""
        mine = json.dumps(asdict(failure))
        try:
            there = self.store.compare_set(self.key, "", mine)
        except Exception as err:
            log.debug("lightning-spot: cannot publish a failure: %s", err)
            return None
        return _decode(there)

    def read(self) -> Failure | None:
        """The first failure, or ``None``; raises when the store cannot be reached (its host is gone)."""
        if not self.store.check([self.key]):
            return None
        return _decode(self.store.get(self.key))


def _decode(raw: bytes | str) -> Failure | None:
    text = raw.decode() if isinstance(raw, bytes) else raw
    if not text:
        return None
    try:
        return Failure(**json.loads(text))
    except (ValueError, TypeError):
        return None
