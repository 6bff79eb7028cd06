"""torchrun's c10d rendezvous, with a way out: a node that leaves (after a notice) removes itself from the round.

torchrun's agent, stopped by a signal, leaves its entry in the rendezvous (closing it would end the job for
everyone), so the other nodes' next round waits until its keep-alive expires: 3 missed heartbeats, 15 s with
torchrun's defaults. :func:`leave` takes the entry out as the agent's own next round would.

    backend = register()                      # before the agent starts; use it as the rendezvous backend
    ...
    leave()                                   # after the workers stopped for a notice
"""

from __future__ import annotations

import logging
import sys
import time
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters, rendezvous_handler_registry

log = logging.getLogger(__name__)

#: the backend name this module registers: torch's c10d rendezvous, its handlers remembered
BACKEND = "lightning-spot-c10d"

_handlers: list[RendezvousHandler] = []
#: how long an agent rides through an unreachable rendezvous store (a coordinator restarting) before it fails
OUTAGE_S = 120
#: the ``--rdzv-conf`` key that sets it (``lightning-spot run --coordinator-outage``)
OUTAGE_KEY = "outage_timeout"


def _create(params: RendezvousParameters) -> RendezvousHandler:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    backend, store = create_backend(params)
    handler = create_handler(store, backend, params)
    handler.get_backend = lambda: BACKEND  # type: ignore[method-assign]  # the registry checks the name it asked for
    if params.get_as_bool("is_host") is False:  # (the store is a coordinator's: it may restart under us)
        survive_store_restarts(backend, handler, params, float(params.get_as_int(OUTAGE_KEY, OUTAGE_S) or OUTAGE_S))
    close_only_when_done(handler)
    _handlers.append(handler)
    return handler


def close_only_when_done(handler: Any) -> None:
    """torch's launcher shuts the rendezvous down (closes it: no node may join that run id again) whenever its
    agent ends, but for a signal. An agent that ends with a failure (restarts spent, the store gone: exit codes a
    scheduler relaunches) only leaves the round here, so that its relaunch, and the nodes still there, can meet
    again under the same id on a store that outlives it (a coordinator's); a job that ended well still closes it."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    close = handler.shutdown

    def shutdown() -> bool:
        failure = sys.exc_info()[1]  # (torch calls this in a `finally`: the exception ending the agent, if any)
        if failure is None:
            return bool(close())
        if isinstance(failure, RendezvousConnectionError):  # (nothing to tell a store that cannot be reached)
            handler._stop_heartbeats()
            return False
        return leave([handler])

    handler.shutdown = shutdown


def survive_store_restarts(
    backend: Any, handler: Any, params: RendezvousParameters, outage: float = float(OUTAGE_S)
) -> None:
    """Let a rendezvous whose store lives elsewhere (``lightning-spot coordinator``) ride through a restart of it.

    torch's agent reads the rendezvous state every monitor interval (are nodes waiting to join?) and fails the
    whole node at the first store error. Here a failed store call connects again and is retried; a store found empty
    (restarted) is given back the last state this agent saw, so that the round, its members and its waiting list
    survive (the first agent back writes it; the others find it). While the store cannot be reached, reads answer
    with that last state and writes fail as a lost race does, for up to ``outage`` seconds; after that the error is
    raised as before."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    host, _, port = params.endpoint.rpartition(":")
    call = backend._call_store
    last: dict[str, Any] = {"value": backend._NULL_SENTINEL.encode(), "since": None}

    def connect() -> None:
        store = TCPStore(host, int(port), is_master=False, multi_tenant=True, timeout=timedelta(seconds=2))
        store.set_timeout(timedelta(seconds=int(params.get_as_int("read_timeout", 60) or 60)))
        # a restarted store holds nothing: put back the last state seen (whoever comes first; the others read it)
        store.compare_set(backend._key, "", _heartbeats_now(last["value"], backend._NULL_SENTINEL).decode())
        backend._store = handler._store = store
        log.warning("lightning-spot: reconnected to the rendezvous store at %s", params.endpoint)

    def resilient(store_op: str, *args: Any, **kwargs: Any) -> Any:
        for attempt in (0, 1):
            try:
                value = call(store_op, *args, **kwargs)
            except RendezvousConnectionError:
                if attempt == 0:
                    try:
                        connect()
                        continue
                    except (RuntimeError, ValueError, TimeoutError):
                        pass
                since = last["since"] = last["since"] or time.monotonic()
                if time.monotonic() - since > outage:
                    raise
                log.warning(
                    "lightning-spot: the rendezvous store at %s is unreachable; keeping the last state", params.endpoint
                )
                # (a read sees the last state, its heartbeats fresh: torch would otherwise find every node dead,
                # itself included, and stop its heartbeats for good; a compare_set sees a lost race)
                return _heartbeats_now(last["value"], backend._NULL_SENTINEL)
            last["since"] = None
            if store_op in ("get", "compare_set") and args and args[0] == backend._key:
                last["value"] = value
            return value
        raise AssertionError("unreachable")

    backend._call_store = resilient


def _heartbeats_now(encoded: bytes, sentinel: str) -> bytes:
    """A rendezvous state as the c10d backend stores it (base64 of a pickle) with every node's last heartbeat set to
    now: a state kept through a store outage must not make the nodes look dead when it is read or written back."""
    import base64
    import pickle
    from datetime import datetime, timezone

    if encoded == sentinel.encode():
        return encoded
    state = pickle.loads(base64.b64decode(encoded))
    now = datetime.now(timezone.utc)
    state.last_heartbeats = dict.fromkeys(state.last_heartbeats, now)
    return base64.b64encode(pickle.dumps(state))


def register() -> str:
    """Register the backend (once per process); its name, for the agent's configuration."""
    try:
        rendezvous_handler_registry.register(BACKEND, _create)
    except ValueError:
        pass  # registered already, with this creator
    return BACKEND


def forget() -> None:
    """Forget the rendezvous made so far (this agent left them and runs again under another id)."""
    _handlers.clear()


def leave(handlers: list[RendezvousHandler] | None = None, seconds: float = 5.0) -> bool:
    """Remove this node from the rendezvous of ``handlers`` (default: every one made here); ``False`` (with a
    warning) when torch's rendezvous does not have the parts this relies on: the others then wait for the
    keep-alive to expire."""
    handlers = _handlers if handlers is None else handlers
    try:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

        for handler in handlers:
            handler._stop_heartbeats()  # type: ignore[attr-defined]
            handler._op_executor.run(_RendezvousExitOp(), time.monotonic() + seconds)  # type: ignore[attr-defined]
    except Exception as err:  # an older or newer torch, or the store is gone (the rendezvous host left)
        log.warning(
            "lightning-spot: could not leave the rendezvous (%s: %s); the other nodes give this one up when its "
            "keep-alive expires",
            type(err).__name__,
            err,
        )
        return False
    return bool(handlers)
