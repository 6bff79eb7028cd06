"""The members of a group between pipelines meet before it is configured, and give up as soon as the quorum broke.

    arrival = Arrival(alive=quorum_alive, timeout=30.0, connect_timeout=3.0)
    arrival.meet("host:port/prefix", rank, size)     # returns once every member is there; else GroupAbandoned
    arrival.abandon("host:port/prefix", "its heal failed")   # the others' meet raises at once

A process group is configured from a quorum's store: every member writes its address there and waits for the
others', up to the group's timeout. A member that died after the quorum formed (killed, a notice, its pipeline
broken), or that gave up (its heal failed), never comes, and the others would wait the whole timeout (30 s) before
the step is run again. So the members first meet on keys of their own in that store, polled every few milliseconds,
and give up as soon as one of them says it gave up (:meth:`abandon`), or a pipeline of the quorum stopped
heartbeating to the lighthouse (``alive``: the lighthouse's page, read four times a second), or the timeout passed.
The caller reports that as the step's error (torchft's ``report_error``): the step does not commit and is run again
with the next quorum, which leaves the broken pipeline out. Only once every member is there is the group configured.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

#: seconds between two looks at the members' keys, and between two reads of whether the quorum's pipelines live
POLL_S = 0.005
ALIVE_EVERY_S = 0.25
#: seconds of one attempt to reach the quorum's store (attempts go on while the quorum lives)
CONNECT_TRY_S = 0.25


class GroupAbandoned(ConnectionError):
    """A group between pipelines was not configured: the quorum it was made for broke (the step is run again)."""


def _refused(store_addr: str) -> None:
    """Raise ``ConnectionRefusedError`` at once when nothing listens at the store's port: the quorum's store lives in
    a member's torchft manager, which served it when the quorum formed; refused now, that member is gone (a TCPStore
    client would retry until its timeout)."""
    host, _, port = store_addr.partition("/")[0].rpartition(":")
    with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TRY_S):
        pass


def store_client(store_addr: str, timeout: float) -> Any:
    """A client of the store at ``host:port/prefix`` (torchft's format), with its keys under ``prefix``."""
    from torchft.process_group import create_store_client

    return create_store_client(store_addr, timeout=timedelta(seconds=timeout))


@dataclass(frozen=True)
class Arrival:
    """How members meet: ``alive()`` says whether every pipeline of the quorum still heartbeats (True when unknown);
    ``timeout`` bounds the wait, ``connect_timeout`` reaching the store."""

    alive: Callable[[], bool]
    timeout: float
    connect_timeout: float

    def meet(self, store_addr: str, rank: int, size: int) -> None:
        """Wait until all ``size`` members reached ``store_addr``; :class:`GroupAbandoned` when the quorum broke."""
        if size < 2:
            return
        started = time.monotonic()
        store = self._reach(store_addr, started)
        store.set(f"arrived/{rank}", "1")
        keys = [f"arrived/{i}" for i in range(size)]
        looked = started
        while True:
            try:
                if store.check(keys):
                    return
                if store.check(["abandoned"]):
                    why = store.get("abandoned").decode(errors="replace")
                    raise GroupAbandoned(f"a member of the group gave up: {why}")
            except GroupAbandoned:
                raise
            except Exception as err:
                raise GroupAbandoned(f"the quorum's store at {store_addr.partition('/')[0]} is gone: {err}") from err
            now = time.monotonic()
            if now - started > self.timeout:
                missing = [k.split("/")[1] for k in keys if not store.check([k])]
                raise GroupAbandoned(f"members {missing} of {size} did not come within {self.timeout:.0f} s")
            if now - looked > ALIVE_EVERY_S:
                looked = now
                if not self.alive():
                    raise GroupAbandoned("a pipeline of the quorum stopped heartbeating (it left or broke)")
            time.sleep(POLL_S)

    def _reach(self, store_addr: str, started: float) -> Any:
        """A client of the quorum's store, tried in short attempts while the quorum lives: its host is a member of
        the quorum, which may have died after the quorum formed (then its heartbeats stop, and this gives up)."""
        attempt = min(CONNECT_TRY_S, self.connect_timeout)
        while True:
            try:
                _refused(store_addr)
                return store_client(store_addr, attempt)
            except Exception as err:
                if (
                    isinstance(err, ConnectionRefusedError)
                    or not self.alive()
                    or (time.monotonic() - started > self.connect_timeout)
                ):
                    host = store_addr.partition("/")[0]
                    raise GroupAbandoned(f"the quorum's store at {host} is gone ({err}".splitlines()[0] + ")") from err

    def abandon(self, store_addr: str, why: str) -> None:
        """Tell the members meeting at ``store_addr`` that this one gave up (best effort, one short attempt: its
        host may be gone, and so are the others' waits then)."""
        try:
            _refused(store_addr)
            store_client(store_addr, min(CONNECT_TRY_S, self.connect_timeout)).set("abandoned", why[:300])
        except Exception:
            pass
