"""A pipeline's first rank learns within milliseconds that another of its ranks exited, and leaves the quorum.

    exits = PeerExits.start(rank, size, on_exit=group.leave_broken)   # at attach, on every rank (collective)
    ...
    exits.close()          # a clean end: the other ranks say goodbye, the first rank stops watching

Only the first rank of a pipeline heartbeats to the lighthouse (its torchft manager serves the others). When another
rank exits (killed, a notice, its node lost with its sockets closed), that rank may be waiting for the next quorum,
not in a collective with it: nothing fails, it keeps heartbeating, and the lighthouse waits its join timeout (5 s) for
the pipeline's quorum request before the other pipelines go on. So each other rank keeps one receive posted by the
first rank over a gloo group of the pipeline: gloo fails it as soon as that rank's process is gone, and the first
rank stops heartbeating at once (``on_exit``): the others' next quorum comes a heartbeat timeout (1 s) later. A node
that vanishes without closing its sockets is found by the agents' rendezvous heartbeats instead (seconds).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

#: how long a posted receive waits before it is posted again (gloo's receives time out with their group)
_WAIT = timedelta(days=1)
#: what a rank sends the first rank when it ends cleanly, and how long it waits for it to be taken
_GOODBYE = 1.0
_GOODBYE_WAIT = timedelta(seconds=5)


class PeerExits:
    """The first rank's receive from each other rank of the pipeline, failed by gloo when that rank exits."""

    def __init__(self, group: object, rank: int, size: int, on_exit: Callable[[int, str], None]) -> None:
        self.group, self.rank, self.size, self.on_exit = group, rank, size, on_exit
        self._closing = threading.Event()
        self._threads: list[threading.Thread] = []

    @classmethod
    def start(cls, rank: int, size: int, on_exit: Callable[[int, str], None]) -> PeerExits | None:
        """(Collective over the pipeline: its world) the watch of a pipeline of ``size`` ranks; None for one rank."""
        if size < 2 or not dist.is_initialized():
            return None
        group = dist.new_group(list(range(size)), timeout=_WAIT, backend="gloo")
        exits = cls(group, rank, size, on_exit)
        if rank == 0:
            for peer in range(1, size):
                thread = threading.Thread(target=exits._watch, args=(peer,), name=f"lightning-spot-exit-{peer}")
                thread.daemon = True
                thread.start()
                exits._threads.append(thread)
        return exits

    def _watch(self, peer: int) -> None:
        """(Rank 0) wait for ``peer``'s goodbye; a receive that fails before it means the peer's process is gone."""
        buffer = torch.zeros(1)
        while not self._closing.is_set():
            try:
                dist.recv(buffer, src=peer, group=self.group)  # type: ignore[arg-type]
            except Exception as err:  # (gloo: "Connection closed by peer", or the receive's own long timeout)
                if self._closing.is_set():
                    return
                if "timed out" in str(err).lower():
                    continue
                self.on_exit(peer, str(err).splitlines()[0][:200] if str(err) else type(err).__name__)
                return
            if float(buffer[0]) == _GOODBYE:
                return

    def close(self) -> None:
        """A clean end of this rank's training (not while an exception is handled: then the first rank is to learn
        of the exit): the other ranks send their goodbye, the first rank stops watching."""
        self._closing.set()
        if self.rank == 0 or sys.exc_info()[0] is not None:
            return
        try:  # (bounded: a first rank that is alive but not receiving must not hold this one's end)
            work = dist.isend(torch.full((1,), _GOODBYE), dst=0, group=self.group)  # type: ignore[arg-type]
            if work is not None:
                work.wait(timeout=_GOODBYE_WAIT)
        except Exception as err:  # (the first rank is gone already)
            log.debug("lightning-spot: no goodbye to rank 0: %s", err)
