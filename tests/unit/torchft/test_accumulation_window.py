"""An accumulation window under torchft, in one process with a scripted torchft Manager: one quorum per window, each
batch's factor from the weights summed over the quorum, a window that does not commit run again whole in a
shrink-only quorum, the commit's plain sum."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from lightning_spot.runtime.loss_weights import LossWeights
from lightning_spot.torchft import TorchFT
from lightning_spot.torchft.replica_group import ReplicaGroup


class _Manager:
    """Two pipelines until the first commit vote fails (the peer died), then this one alone; the peer's weight of
    each batch is 5 and its gradient 0."""

    def __init__(self, **kwargs: Any) -> None:
        self.quorums: list[bool] = []  # shrink_only of each quorum asked for
        self.votes = [False, True]
        self.alone = False
        self.sums: list[torch.Tensor] = []

    def start_quorum(self, shrink_only: bool = False) -> None:
        self.quorums.append(shrink_only)

    def num_participants(self) -> int:
        return 1 if self.alone else 2

    def participating_rank(self) -> int:
        return 0

    def current_step(self) -> int:
        return 0

    def allreduce(self, t: torch.Tensor, reduce_op: Any = None) -> Any:
        if t.numel() == 1 and not self.alone:  # (a batch's weight: the peer's joins it)
            t += 5.0
        self.sums.append(t.clone())
        return types.SimpleNamespace(wait=lambda: None)

    def should_commit(self) -> bool:
        vote = self.votes.pop(0)
        self.alone = self.alone or not vote
        return vote

    def shutdown(self, wait: bool = True) -> None:
        pass


def test_a_window_keeps_its_quorum_and_is_run_again_whole_when_it_does_not_commit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torchft

    monkeypatch.setattr(torchft, "Manager", _Manager)
    monkeypatch.setattr(torchft, "ProcessGroupGloo", lambda **kwargs: types.SimpleNamespace(abort=lambda: None))
    group = ReplicaGroup(
        TorchFT(lighthouse="http://127.0.0.1:1", replica_group="0"), group_rank=1, group_size=2, state_dict=dict
    )
    try:
        param = torch.nn.Parameter(torch.zeros(2))
        group.overlap([param], [], LossWeights(), early=False)
        kept: list[str] = []
        group.keep = lambda: (kept.append("keep"), lambda: kept.append("undo"))[1]
        group.accumulation = lambda: 2
        manager = group.manager
        factors: list[float] = []

        def batch(weight: float, again: bool = True) -> None:
            _, size = group.begin_step(torch.zeros(4, 1), 2, 0, (lambda: batch(weight)) if again else None)
            assert size == 4
            factors.append(group.batch_done(weight))
            param.grad = torch.ones(2) * factors[-1] if param.grad is None else param.grad + factors[-1]

        batch(3.0)
        batch(1.0)
        assert manager.quorums == [False] and kept == ["keep"], "one quorum and one keep for the window"
        assert factors == [pytest.approx(2 * 3 / 8), pytest.approx(2 * 1 / 6)]
        closure_runs: list[int] = []
        run = group.committed(lambda: closure_runs.append(1) or batch(1.0, again=False), lambda: 99.0, lambda: None)
        run()
        if group._next_quorum is not None:
            group._next_quorum.join(timeout=10)
        # the vote failed: undone to the window's start, its first batch run again in a shrink-only quorum, alone
        # (then the next window's quorum, asked for right after the commit)
        assert kept == ["keep", "undo", "keep"] and manager.quorums == [False, True, False]
        assert factors[3:] == [1.0, 1.0] and len(closure_runs) == 2
        # the commit sums plainly (weight 1: the riders' weight element is 1, not the step's 99)
        assert manager.sums[-1].tolist()[-1] == 1.0
        assert group._window is None and group.discarded == 1
    finally:
        group.shutdown()
