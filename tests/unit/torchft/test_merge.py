"""Survivors of broken pipelines merging (Oobleck's merge): which pipeline moves where, over a real TCPStore, and
how its agent's command line changes."""

from __future__ import annotations

import json
import os
import pickle
import time
import types
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from lightning_spot.torchft.merge import SurvivorMerge
from lightning_spot_launch import MOVED_EXIT_CODE, PEER_LOST_EXIT_CODE
from lightning_spot_launch.failures import agent_exit_code, is_error
from lightning_spot_launch.moves import Target, relaunch_as, run_with_env
from lightning_spot_launch.waiting import (
    ARRIVAL_SECONDS,
    FRESH_SECONDS,
    REGISTRY_KEY,
    Waiting,
    claim,
    decide,
    target_for_returning_node,
)


def _waiting(group: str, nodes: int = 1, max_nodes: int = 2, beat: float = 100.0) -> Waiting:
    return Waiting(group=group, nodes=nodes, max_nodes=max_nodes, run_id=f"p{group}", beat=beat)


def test_the_pipeline_of_the_higher_group_moves_to_a_waiting_one_with_room() -> None:
    registry = decide({}, _waiting("1"), "t1", now=100.0)
    assert registry["moves"] == {} and list(registry["waiting"]) == ["1"], "alone: it only waits"
    registry = decide(registry, _waiting("2"), "t2", now=100.5)
    assert registry["moves"]["t2"]["group"] == "1" and registry["moves"]["t2"]["run_id"] == "p1"
    target = Waiting(**registry["waiting"]["1"])
    assert list(registry["waiting"]) == ["1"] and target.room(100.5) == 0, "its node is on its way to the target"
    # the target's next heartbeat (same wait) keeps the place taken: a third survivor finds no room there
    registry = decide(registry, _waiting("1", beat=101.0), "t1", now=101.0)
    registry = decide(registry, _waiting("3"), "t3", now=101.0)
    assert "t3" not in registry["moves"]
    # a place is kept while the node may still be on its way; a new wait of the target starts afresh
    assert Waiting(**registry["waiting"]["1"]).room(100.5 + ARRIVAL_SECONDS + 1) == 1
    assert Waiting(**decide(registry, _waiting("1"), "t1-again", now=101.0)["waiting"]["1"]).room(101.0) == 1
    # the lower group never moves to a higher one
    assert "t0" not in decide({"waiting": {"5": _waiting("5").__dict__}}, _waiting("0"), "t0", now=100.0)["moves"]


def test_a_stale_or_full_pipeline_is_not_a_target_and_groups_are_ordered_by_number() -> None:
    stale = {"waiting": {"1": _waiting("1", beat=100.0 - FRESH_SECONDS - 1).__dict__}}
    assert decide(stale, _waiting("2"), "t", now=100.0)["moves"] == {}
    big = {"waiting": {"1": _waiting("1", nodes=3, max_nodes=4).__dict__}}
    assert decide(big, _waiting("2", nodes=2), "t", now=100.0)["moves"] == {}, "3 + 2 nodes > 4"
    assert decide(big, _waiting("2", nodes=1), "t", now=100.0)["moves"]["t"]["group"] == "1"
    ten = {"waiting": {"10": _waiting("10").__dict__}}
    assert decide(ten, _waiting("9"), "t", now=100.0)["moves"] == {}, "9 < 10: pipeline 10 moves to 9, not back"


def test_waiting_pipelines_meet_in_the_registry_on_a_shared_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two waiting pipelines' first ranks and the second rank of the one that moves, each a client of one TCPStore
    (as the coordinator's): the move is decided once and read by every rank of the moving pipeline."""
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    monkeypatch.setenv("LIGHTNING_SPOT_SHARED_STORE", f"127.0.0.1:{server.port}")
    monkeypatch.setenv("LIGHTNING_SPOT_MAX_NODES", "2")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "p1")
    one = SurvivorMerge.from_env("1", "token-1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "p2")
    two, two_rank1 = SurvivorMerge.from_env("2", "token-2"), SurvivorMerge.from_env("2", "token-2")
    assert one is not None and two is not None and two_rank1 is not None
    assert one.tick(decide_here=True) is None
    assert two_rank1.tick(decide_here=False) is None, "only the first rank decides"
    assert two.tick(decide_here=True) == Target("1", "p1")
    assert two_rank1.tick(decide_here=False) == Target("1", "p1")
    assert one.tick(decide_here=True) is None, "the target stays where it is"
    monkeypatch.delenv("LIGHTNING_SPOT_SHARED_STORE")
    assert SurvivorMerge.from_env("3", "t") is None, "no shared store (each pipeline hosts its rendezvous): no merge"


def test_a_moving_node_runs_its_agent_again_under_the_target_rendezvous_and_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The agent's configuration takes the target's rendezvous id and its environment the target's group; forked
    workers (whose environment is the fork server's, started under the old group) are handed it."""
    monkeypatch.setenv("REPLICA_GROUP_ID", "2")
    config = types.SimpleNamespace(run_id="p2")

    def train(*args: str) -> None: ...

    entrypoint, args = relaunch_as(Target("1", "p1"), config, train, ("train.py", "--x"))
    assert config.run_id == "p1" and os.environ["REPLICA_GROUP_ID"] == "1"
    assert entrypoint is run_with_env and args == ({"REPLICA_GROUP_ID": "1"}, train, "train.py", "--x")
    assert relaunch_as(Target("1", "p1"), config, "python", ("-u", "train.py")) == ("python", ("-u", "train.py"))
    assert not is_error([MOVED_EXIT_CODE]) and agent_exit_code([MOVED_EXIT_CODE, PEER_LOST_EXIT_CODE]) == 69


def test_a_registry_that_cannot_be_reached_leaves_the_pipeline_waiting(capsys: pytest.CaptureFixture[str]) -> None:
    """The coordinator restarting while survivors wait: no move, no crash (a crash would count as an error of the
    job's code), one line said."""

    class _Gone:
        def compare_set(self, *args: object) -> bytes:
            raise RuntimeError("connection reset")

    merge = SurvivorMerge(_Gone(), _waiting("2"), "t")
    assert merge.tick(decide_here=True) is None and merge.tick(decide_here=False) is None
    assert capsys.readouterr().err.count("cannot be read now (connection reset)") == 1


def test_a_node_back_to_a_full_pipeline_takes_a_place_in_a_waiting_one() -> None:
    """After a merge, pipeline 1 is full (its node b's place went to pipeline 2's node). Node 1b comes back: its
    rendezvous (torch's c10d state on the store) is complete with 2 of 2 nodes, so it takes the place pipeline 2
    waits to fill, in the registry; once that is taken, or with room in its own pipeline, it joins its own."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    assert target_for_returning_node(store, "p1", max_nodes=2) is None, "no round yet: its own pipeline"
    state = _RendezvousState()
    state.complete = True
    state.participants = {_NodeDesc("a", 1, 0): 0, _NodeDesc("b", 1, 0): 1}
    backend = C10dRendezvousBackend(store, "p1")
    backend.set_state(pickle.dumps(state))
    registry = {"waiting": {"2": _waiting("2", beat=time.time()).__dict__}}
    store.set(REGISTRY_KEY, json.dumps(registry))
    assert target_for_returning_node(store, "p1", max_nodes=3) is None, "room in its own pipeline (2 of 3)"
    assert target_for_returning_node(store, "p1", max_nodes=2) == Target("2", "p2")
    assert target_for_returning_node(store, "p1", max_nodes=2) is None, "pipeline 2's place is taken now"
    assert claim({}, 1, now=0.0) == ({}, None)
