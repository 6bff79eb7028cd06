"""The checkpoint rules the strategy hands to SpotCheckpoint: a pipeline alone, and torchft's replicated pipelines."""

from __future__ import annotations

from typing import Any

from lightning_spot.checkpoint.replica_rules import OwnCheckpoints
from lightning_spot.torchft.checkpoint_rules import ReplicatedCheckpoints
from lightning_spot.torchft.no_replicas import NoReplicas


class FakeReplicas(NoReplicas):
    """A replica group as the rules see it: this pipeline's place in the quorum and its pending events."""

    def __init__(self, participant_rank: int, events: list[dict[str, Any]]) -> None:
        self.participant_rank = participant_rank
        self._events = events

    def take_events(self) -> list[dict[str, Any]]:
        events, self._events = self._events, []
        return events


def test_a_pipeline_alone_writes_every_checkpoint_and_keeps_snapshots() -> None:
    rules = OwnCheckpoints()
    assert rules.writes() and rules.keeps_snapshots
    assert rules.history_id is None and rules.events() == []


def test_replicated_pipelines_write_from_the_first_of_the_quorum_and_keep_their_own_snapshots() -> None:
    group: list[Any] = [NoReplicas()]  # before fit attaches the replica group: the null object
    rules = ReplicatedCheckpoints("1", lambda: group[0])
    # (each its own: the snapshot store is keyed by the history id, the replica group)
    assert rules.keeps_snapshots and rules.history_id == "1"
    assert rules.writes() and rules.events() == []
    group[0] = FakeReplicas(1, [{"kind": "quorum", "step": 4}])  # attached: the second pipeline of the quorum
    assert not rules.writes()
    assert rules.events() == [{"kind": "quorum", "step": 4}] and rules.events() == []  # each event once
    group[0] = FakeReplicas(0, [])  # the first pipeline left: this one writes now
    assert rules.writes()
