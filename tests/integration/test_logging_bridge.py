"""A step's logged values combined over micro-batches and replicas (``PackedLogs``), without processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def test_a_receive_posted_before_the_step_gets_the_step_s_values_and_leaves_the_pipeline_s_sends_alone(
    tmp_path: Path,
) -> None:
    """The first stage posts the receive of a step's logged values before the step's schedule (the last stage's
    send then finds it waiting); the pipeline's point-to-point tensors between the same ranks pass meanwhile, and
    every step's values arrive in order, through a change of names and an evaluation step that posts nothing."""
    from tests.distributed import launch
    from tests.workers.share_values import STEPS

    launch(2, ["tests/workers/share_values.py", str(tmp_path)], log_dir=tmp_path / "logs", timeout=120)
    expected = [{name: step + i / 10 for i, name in enumerate(names)} for step, (_, names) in enumerate(STEPS)]
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == expected  # (float64 all the way)


def test_the_last_stages_exchange_logged_sums_point_to_point_with_an_all_reduce_s_result(tmp_path: Path) -> None:
    """Three gloo ranks reduce with ``group_reducer`` (messages on the calling thread, not a collective): sums equal
    ``dist.all_reduce``'s and are the same bits on every rank (values of very different sizes, where the order of
    the additions shows), largest values are exact, a smallest value falls back to the all-reduce; a pipeline's
    tensors in flight between the same ranks under the default tag stay apart."""
    from tests.distributed import launch
    from tests.workers.exchange_reduce import STEPS

    launch(3, ["tests/workers/exchange_reduce.py", str(tmp_path)], log_dir=tmp_path / "logs", timeout=120)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(3)]
    assert len(ranks[0]) == STEPS
    for step in range(STEPS):
        got = [rank[step] for rank in ranks]
        for one in got:
            assert one["sums"] == pytest.approx(one["expected_sums"], rel=1e-6)
            assert one["highs"] == one["expected_highs"]
            assert one["lows"] == one["expected_lows"]
        assert got[0]["sums"] == got[1]["sums"] == got[2]["sums"]
