"""The registry of pipelines waiting for nodes, on the rendezvous store every pipeline shares (a coordinator's).

    registry = Registry(store)                                   # a TCPStore client of the coordinator's store
    registry.update(lambda r: decide(r, me, token, time.time())) # a waiting pipeline's heartbeat (and move)
    target = returning_node_target(config)                       # an agent, before it joins: None or elsewhere

A pipeline that cannot hold the model on the nodes it has left waits (``lightning_spot.torchft.stage_memory``) and
keeps an entry here: its group, nodes, the most nodes its rendezvous takes, its rendezvous id and a heartbeat.
Survivors of two broken pipelines merge through it (``lightning_spot.torchft.merge``: :func:`decide`); a node that
comes back to a pipeline whose rendezvous is full (its place taken by a moved node) joins a waiting pipeline with
room instead (:func:`claim`). Every change is one compare-and-set of the whole registry, so that two pipelines
never take one place. In the launcher's package, as the agent reads it before it imports Lightning.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from lightning_spot_launch.moves import SHARED_STORE_ENV, Target

#: the registry's key on the shared store
REGISTRY_KEY = "lightning-spot/waiting-pipelines"
#: an entry heartbeating less long ago than this is a pipeline still waiting
FRESH_SECONDS = 5.0
#: moves are kept this long in the registry (for the ranks of the moving pipeline to read)
MOVES_KEPT_SECONDS = 120.0
#: a place taken in a waiting pipeline is kept this long for the node on its way (its agent's start and join)
ARRIVAL_SECONDS = 60.0


def group_order(group: str) -> tuple[int, int | str]:
    """Groups in order, numbers by value: the pipeline of the lower group is the one others move to."""
    return (0, int(group)) if group.isdigit() else (1, group)


@dataclass(frozen=True)
class Waiting:
    """A pipeline waiting for nodes, as the registry holds it; ``incoming``: ``[nodes, time]`` of the nodes that
    took a place in it (a move, a returning node) and may still be on their way (its heartbeat keeps them)."""

    group: str
    nodes: int
    max_nodes: int
    run_id: str
    beat: float
    token: str = ""
    incoming: tuple[tuple[int, float], ...] = ()

    def room(self, now: float) -> int:
        """Places left: its most nodes, less its own and those on their way (for :data:`ARRIVAL_SECONDS`)."""
        coming = sum(n for n, since in self.incoming if now - since < ARRIVAL_SECONDS)
        return self.max_nodes - self.nodes - coming

    def taking(self, nodes: int, now: float) -> Waiting:
        """This pipeline with ``nodes`` more on their way."""
        return replace(self, incoming=(*map(tuple, self.incoming), (nodes, now)))  # type: ignore[arg-type]


def _waiting_of(registry: dict[str, Any]) -> dict[str, Waiting]:
    return {g: Waiting(**w) for g, w in registry.get("waiting", {}).items()}


def _best(candidates: list[Waiting]) -> Waiting | None:
    return min(candidates, key=lambda w: group_order(w.group)) if candidates else None


def decide(registry: dict[str, Any], me: Waiting, token: str, now: float) -> dict[str, Any]:
    """The registry after ``me``'s heartbeat (the wait ``token``): with a move of ``me`` to a waiting pipeline of a
    lower group that has room for its nodes, when there is one (pure: the compare-and-set retries it)."""
    waiting = _waiting_of(registry)
    moves = {t: m for t, m in registry.get("moves", {}).items() if now - m["time"] < MOVES_KEPT_SECONDS}
    if token not in moves:
        held = waiting.get(me.group)
        kept = held.incoming if held is not None and held.token == token else ()  # (a new wait starts afresh)
        waiting[me.group] = replace(me, token=token, incoming=kept)
        target = _best(
            [
                w
                for w in waiting.values()
                if w.group != me.group
                and now - w.beat < FRESH_SECONDS
                and group_order(w.group) < group_order(me.group)
                and w.room(now) >= me.nodes
            ]
        )
        if target is not None:
            del waiting[me.group]
            waiting[target.group] = target.taking(me.nodes, now)
            moves[token] = {"group": target.group, "run_id": target.run_id, "time": now}
    return {"waiting": {g: asdict(w) for g, w in waiting.items()}, "moves": moves}


def claim(registry: dict[str, Any], nodes: int, now: float) -> tuple[dict[str, Any], Target | None]:
    """The registry after a node (``nodes`` of them) that comes back to a full pipeline took a place in the waiting
    pipeline of the lowest group with room, and that pipeline (``None``: no room anywhere) (pure)."""
    waiting = _waiting_of(registry)
    target = _best([w for w in waiting.values() if now - w.beat < FRESH_SECONDS and w.room(now) >= nodes])
    if target is None:
        return registry, None
    waiting[target.group] = target.taking(nodes, now)
    return {**registry, "waiting": {g: asdict(w) for g, w in waiting.items()}}, Target(target.group, target.run_id)


class Registry:
    """The registry on a store (a ``torch.distributed.Store``): read it, change it by compare-and-set."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def read(self) -> dict[str, Any]:
        raw = self.store.compare_set(REGISTRY_KEY, "", "{}")  # (the value, created empty if missing)
        return json.loads(raw) if raw else {}

    def update(self, change: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
        """Apply ``change`` (pure: it may run again when another pipeline wrote in between); the registry written."""
        for _ in range(20):
            raw = self.store.compare_set(REGISTRY_KEY, "", "{}")
            changed = change(json.loads(raw) if raw else {})
            new = json.dumps(changed).encode()
            if self.store.compare_set(REGISTRY_KEY, raw, new) == new:
                return changed
            time.sleep(0.05)
        raise TimeoutError("the registry of waiting pipelines kept changing under 20 compare-and-sets")


def rendezvous_full(store: Any, run_id: str, max_nodes: int) -> bool:
    """Whether pipeline ``run_id``'s rendezvous (torch's c10d state on ``store``) has a round of ``max_nodes``
    nodes that is complete and open: a node joining it would only wait for a place."""
    key = f"torch.rendezvous.{run_id}"
    if not store.check([key]):
        return False
    try:
        state = pickle.loads(base64.b64decode(store.get(key)))
    except Exception:  # (not a state this torch writes: assume there is room, as torch's own join would)
        return False
    return bool(state.complete and not state.closed and len(state.participants) >= max_nodes)


def target_for_returning_node(store: Any, run_id: str, max_nodes: int, nodes: int = 1) -> Target | None:
    """Where a node starting for pipeline ``run_id`` goes: ``None`` (its own pipeline) unless that pipeline is full
    and a waiting pipeline has room; then that one, its place taken in the registry."""
    if not rendezvous_full(store, run_id, max_nodes):
        return None
    taken: list[Target | None] = [None]

    def take(registry: dict[str, Any]) -> dict[str, Any]:
        registry, taken[0] = claim(registry, nodes, time.time())
        return registry

    Registry(store).update(take)
    return taken[0]


def shared_store() -> Any | None:
    """A client of the rendezvous store every pipeline shares (a coordinator's, named by the agent in the
    environment: ``moves.worker_env``); ``None`` without one (each pipeline hosts its own) or when it cannot be
    reached."""
    address = os.environ.get(SHARED_STORE_ENV)
    if not address:
        return None
    from datetime import timedelta

    from torch.distributed import TCPStore

    host, _, port = address.rpartition(":")
    try:
        return TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
    except (RuntimeError, ValueError, TimeoutError):
        return None


def returning_node_target(config: Any) -> Target | None:
    """(The agent, before it joins its rendezvous) where this node goes: :func:`target_for_returning_node` on the
    coordinator's store; ``None`` without one, or when it cannot be read (torch's join then says why)."""
    store = shared_store()
    if store is None:
        return None
    try:
        return target_for_returning_node(store, config.run_id, int(config.max_nodes))
    except (RuntimeError, ValueError, TimeoutError):
        return None
