"""What the torchft unit tests share: torchft's Manager stood in for, and a replica group built on it."""

from __future__ import annotations

import types
from typing import Any, ClassVar

import pytest

from lightning_spot.torchft import TorchFT, replica_group
from lightning_spot.torchft.replica_group import ReplicaGroup


class FakeManager:
    """torchft's Manager as ReplicaGroup uses it; each quorum is the next of ``quorums`` (replica ids, the step it
    sets, whether it heals this pipeline)."""

    quorums: ClassVar[list[tuple[list[str], int, bool]]] = []

    def __init__(self, load_state_dict: Any, replica_id: str, **kwargs: Any) -> None:
        self.load_state_dict_fn, self.replica_id, self.step, self.asked, self.stopped = (
            load_state_dict,
            replica_id,
            0,
            0,
            False,
        )
        self._client = types.SimpleNamespace(_quorum=self._answer)

    def _answer(self, **kwargs: Any) -> Any:
        ids, step, heal = self.quorums[min(self.asked, len(self.quorums) - 1)]
        self.asked += 1
        self.step = step
        if heal:
            self.load_state_dict_fn({"from": "a peer"})
        return types.SimpleNamespace(replica_ids=[f"{self.replica_id}:me", *ids])

    def start_quorum(self) -> None:
        self._client._quorum()  # (the recorded client ReplicaGroup installed)

    def current_step(self) -> int:
        return self.step

    def participating_rank(self) -> int:
        return 0

    def num_participants(self) -> int:
        return 1

    def shutdown(self, wait: bool = True) -> None:
        self.stopped = True


@pytest.fixture
def fake_torchft(monkeypatch: pytest.MonkeyPatch) -> type[FakeManager]:
    import torchft

    monkeypatch.setattr(torchft, "Manager", FakeManager)
    monkeypatch.setattr(torchft, "ProcessGroupGloo", lambda **kwargs: None)
    monkeypatch.setattr(replica_group, "JOIN_RETRY_SECONDS", 0.01)
    return FakeManager


def make_group(
    quorums: list[tuple[list[str], int, bool]], fake: type[FakeManager], timeout: float = 5.0
) -> ReplicaGroup:
    fake.quorums = quorums
    settings = TorchFT(lighthouse="http://127.0.0.1:1", replica_group="1", quorum_timeout=timeout)
    return ReplicaGroup(settings, group_rank=1, group_size=2, state_dict=dict, layout="s2c2")  # (rank 1: no dial)
