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
import time

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters, rendezvous_handler_registry

log = logging.getLogger(__name__)

#: the backend name this module registers: torch's c10d rendezvous, its handlers remembered
BACKEND = "lightning-spot-c10d"

_handlers: list[RendezvousHandler] = []


def _create(params: RendezvousParameters) -> RendezvousHandler:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    backend, store = create_backend(params)
    handler = create_handler(store, backend, params)
    handler.get_backend = lambda: BACKEND  # type: ignore[method-assign]  # the registry checks the name it asked for
    _handlers.append(handler)
    return handler


def register() -> str:
    """Register the backend (once per process); its name, for the agent's configuration."""
    try:
        rendezvous_handler_registry.register(BACKEND, _create)
    except ValueError:
        pass  # registered already, with this creator
    return BACKEND


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
