"""Recover training state from the in-memory snapshots that survive, onto any layout.

    recall = Recall.gather(store, needs, group)   # collective: what each node holds, what each rank needs
    step = recall.newest_complete()               # newest step whose shares cover every rank's needs
    got = recall.fetch(step)                      # collective: this rank's tensors, read or received

Every rank states the tensors it needs (stored names, by group: ``model``, ``optimizer_0``, ...) and
which shares its node holds. A step is complete when, for every rank, the shares of that step on the
surviving nodes hold every name it needs. Each rank then reads what its own node holds and receives
the rest from a rank on a node that holds it (point to point, only the names it needs), so that
recovery onto a new layout moves each tensor once.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_spot.checkpoint import model_copies
from lightning_spot.checkpoint.memory.snapshot import SnapshotStore, cover, encode_tensors
from lightning_spot.utils.distributed import all_gather_object, exchange_bytes, rank

Needs = dict[str, list[str]]  # group ("model", "optimizer_0", ...) -> stored names
Tensors = dict[str, dict[str, torch.Tensor]]


@dataclass(frozen=True)
class Source:
    """Part of a rank's state: the ``names`` of the share of ``old_rank``, read by rank ``reader``."""

    reader: int
    old_rank: int
    names: Needs


@dataclass
class Recalled:
    """What :meth:`Recall.fetch` gives one rank."""

    tensors: Tensors
    optimizer_values: list[dict[str, Any]]
    lightning: dict[str, Any]
    info: dict[str, Any]
    rng: Any = None  # this rank's own RNG state, when its share of the same rank was among the sources
    layout: dict[str, Any] = field(default_factory=dict)  # the layout the snapshot was taken on


class Recall:
    """The surviving snapshots of a job and every rank's needs (the same on every rank)."""

    def __init__(
        self,
        store: SnapshotStore,
        nodes: list[str],
        held: list[dict[int, dict[int, dict[str, Any]]]],
        needs: list[Needs],
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.store = store
        self.nodes = nodes  # per rank: its node's store
        self.held = held  # per rank: {step: {old rank: meta}} on its node
        self.needs = needs
        self.group = group
        self.me = rank(group)

    @classmethod
    def gather(cls, store: SnapshotStore, needs: Needs, group: dist.ProcessGroup | None = None) -> Recall:
        """Collective: every rank's node and its shares, and every rank's needs."""
        everyone = all_gather_object((store.node_key, store.shares(), needs), group)
        return cls(store, [e[0] for e in everyone], [e[1] for e in everyone], [e[2] for e in everyone], group)

    def steps(self) -> list[int]:
        """Steps some surviving node holds a share of, newest first."""
        return sorted({s for held in self.held for s in held}, reverse=True)

    def plan(self, step: int) -> tuple[dict[int, list[Source]] | None, str]:
        """Where every rank's tensors of ``step`` come from, or ``None`` and what is missing."""
        holders: dict[int, list[int]] = {}
        metas: dict[int, dict[str, Any]] = {}
        for current, held in enumerate(self.held):
            for old, meta in held.get(step, {}).items():
                holders.setdefault(old, []).append(current)
                metas[old] = meta
        plan: dict[int, list[Source]] = {}
        # copies of the model's state (``model_copies``) hold the model's names: each rank needs its own there too
        copies = {g for meta in metas.values() for g in meta["names"] if g.startswith(model_copies.PREFIX)}
        for d, needs in enumerate(self.needs):
            needs = {**needs, **{g: needs.get("model", []) for g in copies}}
            # its own share first (RNG), then shares on its own node, then the others
            order = sorted(metas, key=lambda r: (r != d, d not in holders[r], r))
            used, missing = cover({g: set(n) for g, n in needs.items()}, [(r, metas[r]["names"]) for r in order])
            if missing:
                return None, (
                    f"the snapshots of step {step} that survive (shares of ranks {sorted(metas)}) lack "
                    f"{len(missing)} tensor(s) rank {d} needs, e.g. {missing[0]}"
                )
            plan[d] = [Source(_reader(d, holders[old]), old, take) for old, take in used]
        return plan, ""

    def newest_complete(self) -> tuple[int | None, str]:
        """The newest step every rank can recover from memory, and why newer ones cannot be used."""
        why: list[str] = []
        for step in self.steps():
            plan, problem = self.plan(step)
            if plan is not None:
                return step, "; ".join(why)
            why.append(problem)
        return None, "; ".join(why) or "no snapshot survives"

    def fetch(self, step: int) -> Recalled:
        """Collective: this rank's tensors of ``step`` from its node's files and from peers that hold them."""
        plan, problem = self.plan(step)
        if plan is None:
            raise RuntimeError(problem)
        loaded: dict[int, tuple[Tensors, dict[str, Any]]] = {}

        def load(old: int) -> tuple[Tensors, dict[str, Any]]:
            if old not in loaded:
                loaded[old] = (self.store.read_tensors(step, old), self.store.read_state(step, old))
            return loaded[old]

        def part(source: Source) -> dict[str, Any]:
            tensors, state = load(source.old_rank)
            picked = {g: {n: tensors[g][n] for n in names} for g, names in source.names.items()}
            return {"tensors": picked, "state": state, "old_rank": source.old_rank}

        outgoing = [(d, s) for d, sources in plan.items() if d != self.me for s in sources if s.reader == self.me]
        incoming = [s for s in plan[self.me] if s.reader != self.me]
        parts = [part(s) for s in plan[self.me] if s.reader == self.me]
        received = exchange_bytes(
            [(d, s.old_rank, encode_tensors(part(s))) for d, s in outgoing],
            [(s.reader, s.old_rank) for s in incoming],
            self.group,
        )
        parts += [torch.load(io.BytesIO(data), weights_only=True) for data in received]
        return _assemble(parts, plan[self.me], self.me, self.held, step)


def _reader(rank: int, holders: list[int]) -> int:
    """Who reads a share for ``rank``: itself when its node holds it, else one of the holders (spread by rank)."""
    return rank if rank in holders else holders[rank % len(holders)]


def _assemble(
    parts: list[dict[str, Any]],
    sources: list[Source],
    me: int,
    held: list[dict[int, dict[int, dict[str, Any]]]],
    step: int,
) -> Recalled:
    tensors: Tensors = {}
    values: list[dict[str, Any]] = []
    for p in parts:
        for g, named in p["tensors"].items():
            tensors.setdefault(g, {}).update(named)
        for i, v in enumerate(p["state"]["optimizer_values"]):
            while len(values) <= i:
                values.append({})
            values[i].update(v)
    first = min(parts, key=lambda p: p["old_rank"])
    own = next((p for p in parts if p["old_rank"] == me), None)
    meta = next(h[step][first["old_rank"]] for h in held if first["old_rank"] in h.get(step, {}))
    return Recalled(
        tensors=tensors,
        optimizer_values=values,
        lightning=first["state"]["lightning"],
        info=first["state"]["info"],
        rng=own["state"]["rng"] if own is not None else None,
        layout=meta["layout"],
    )
