"""Survivors of two broken pipelines merge into one (Oobleck's merge), over the coordinator's store.

    merge = SurvivorMerge.from_env(group="2", token=token)   # None: no store shared by the pipelines
    target = merge.tick(decide=first_rank)                   # every second while the pipeline waits for nodes

A pipeline whose nodes cannot hold the model waits for them (``stage_memory.wait_for_nodes``). While it waits, its
first rank keeps an entry in the registry of waiting pipelines on the rendezvous store every pipeline shares
(``lightning-spot coordinator``'s; ``lightning_spot_launch.waiting``): its group, its nodes, the most nodes its
rendezvous takes, its rendezvous id and a heartbeat.
When another pipeline waits too, with a lower group, and its nodes plus this one's fit its rendezvous, this one
moves there: in one compare-and-set it leaves the registry, adds its nodes to the other's entry (so that no third
pipeline moves there too) and records the move under its wait's token. Every rank of the pipeline reads the move,
writes it for its agent and exits with ``MOVED_EXIT_CODE``; the agents join the other pipeline's rendezvous
(``lightning_spot_launch.moves``), whose agent starts it again, deeper, and it takes a live pipeline's state.
Entries whose heartbeat is older than ``waiting.FRESH_SECONDS`` are ignored (a pipeline that started again, or died).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from typing import Any

from lightning_spot_launch.moves import MAX_NODES_ENV, Target
from lightning_spot_launch.waiting import Registry, Waiting, decide, shared_store


class SurvivorMerge:
    """One waiting pipeline's side of the registry (see the module's text)."""

    def __init__(self, store: Any, me: Waiting, token: str) -> None:
        self.registry = Registry(store)
        self.me = me
        self.token = token
        self._warned = False

    @classmethod
    def from_env(cls, group: str, token: str) -> SurvivorMerge | None:
        """From the agent's environment (``lightning_spot_launch.moves.worker_env``); ``None`` when the pipelines
        share no store (each hosts its own rendezvous) or it cannot be reached."""
        store = shared_store()
        if store is None:
            return None
        nodes = max(1, int(os.environ.get("WORLD_SIZE", 1)) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
        me = Waiting(
            group=group,
            nodes=nodes,
            max_nodes=int(os.environ.get(MAX_NODES_ENV, nodes)),
            run_id=os.environ.get("TORCHELASTIC_RUN_ID", ""),
            beat=0.0,
        )
        return cls(store, me, token)

    def tick(self, decide_here: bool) -> Target | None:
        """Heartbeat (and move, when there is room elsewhere) if ``decide_here`` (the pipeline's first rank); the
        pipeline's move, once one is recorded for this wait."""
        try:
            if decide_here:
                self.registry.update(lambda registry: decide(registry, self._beat(), self.token, time.time()))
            move = self.registry.read().get("moves", {}).get(self.token)
        except (RuntimeError, TimeoutError, ValueError) as err:  # (the store unreachable: a coordinator restarting)
            if not self._warned:
                print(
                    f"lightning-spot: the registry of waiting pipelines cannot be read now ({err}); waiting on",
                    file=sys.stderr,
                    flush=True,
                )
                self._warned = True
            return None
        return Target(move["group"], move["run_id"]) if move is not None else None

    def _beat(self) -> Waiting:
        return replace(self.me, beat=time.time())
