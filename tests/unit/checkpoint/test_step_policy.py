"""SpotCheckpoint's decision at each step's end, without a Trainer: the same agreed values give every rank the same
decision."""

from __future__ import annotations

import logging

import pytest

from lightning_spot.checkpoint import step_policy
from lightning_spot.checkpoint.step_policy import Agreed, StepDecision, StepPolicy


def agreed(**kw: float) -> Agreed:
    base = {"notice": 0, "snapshot_elapsed": 0.0, "snapshot_every": 0.0, "durable_elapsed": 0.0}
    values = {**base, "durable_every": 0.0, "writing": 0, **kw}
    return Agreed.of([values[k] for k in ("notice", "snapshot_elapsed", "snapshot_every", "durable_elapsed",
                                          "durable_every", "writing")])  # fmt: skip


def test_saves_by_steps_and_snapshots_in_between() -> None:
    policy = StepPolicy(every_n_train_steps=10, snapshot_every_n_train_steps=2, snapshots=True, save_on_train_end=True)
    decisions = {step: policy.decide(step, None, ending=False) for step in range(1, 11)}
    assert [s for s, d in decisions.items() if d.snapshot] == [2, 4, 6, 8]
    assert [s for s, d in decisions.items() if d.save] == [10] and decisions[10].save == "periodic"
    assert decisions[3] == StepDecision()
    without = StepPolicy(
        every_n_train_steps=10, snapshot_every_n_train_steps=2, snapshots=False, save_on_train_end=True
    )
    assert not without.decide(4, None, ending=False).snapshot, "no snapshot store: no snapshots"


def test_the_clock_and_the_end_of_training() -> None:
    policy = StepPolicy(None, None, snapshots=True, save_on_train_end=True)
    assert policy.decide(7, agreed(durable_elapsed=61.0, durable_every=60.0), ending=False).save == "periodic"
    assert policy.decide(7, agreed(snapshot_elapsed=2.5, snapshot_every=2.0), ending=False).snapshot
    assert policy.decide(7, agreed(snapshot_elapsed=1.5, snapshot_every=2.0), ending=False) == StepDecision()
    assert policy.decide(7, None, ending=True).save == "end"
    kept = StepPolicy(None, None, snapshots=True, save_on_train_end=False)
    assert kept.decide(7, None, ending=True) == StepDecision()
    both = policy.decide(7, agreed(durable_elapsed=61.0, durable_every=60.0), ending=True)
    assert both.save == "periodic", "a save due by the clock at the last step is a periodic one"


def test_a_notice_stops_and_a_snapshot_waits_for_the_previous_write(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    policy = StepPolicy(None, None, snapshots=True, save_on_train_end=True)
    assert policy.decide(3, agreed(notice=1), ending=False).stop_for_notice
    monkeypatch.setattr(step_policy, "POSTPONED_WARN_SECONDS", 5.0)
    with caplog.at_level(logging.WARNING):
        waiting = [
            policy.decide(s, agreed(snapshot_elapsed=s, snapshot_every=2.0, writing=1), False) for s in (3, 6, 9)
        ]
        assert not any(d.snapshot for d in waiting), "a rank still writes the previous snapshot"
        assert policy.decide(10, agreed(snapshot_elapsed=10.0, snapshot_every=2.0), ending=False).snapshot
    said = [r for r in caplog.records if "still writing the previous one" in r.getMessage()]
    assert len(said) == 1, "a long wait is said once"


def test_settings_changed_after_construction_reach_the_parts_that_act_on_them() -> None:
    """As users change ModelCheckpoint's attributes after making it: SpotCheckpoint's settings have one value, held
    by the part that acts on each (the policy, the cadence, the saver, the recorder)."""
    from lightning_spot import SpotCheckpoint

    ckpt = SpotCheckpoint(every_n_train_steps=10, keep_last=3)
    assert not ckpt.policy.decide(5, None, ending=False).save
    ckpt.every_n_train_steps = 5
    ckpt.keep_last, ckpt.async_save, ckpt.io_threads, ckpt.heartbeat_seconds = 1, False, 4, 2.0
    ckpt.snapshot_every_n_train_steps, ckpt.every_n_minutes = 2, 1.5
    assert ckpt.policy.decide(5, None, ending=False).save == "periodic"
    assert ckpt.cadence.durable_steps == 5 and ckpt.cadence.snapshot_steps == 2 and ckpt.cadence.durable_minutes == 1.5
    assert (ckpt.saver.keep_last, ckpt.saver.async_save, ckpt.saver.io_threads) == (1, False, 4)
    assert ckpt.recorder.heartbeat_seconds == 2.0 and ckpt.keep_last == 1
    ckpt.save_on_train_end = False
    assert ckpt.policy.decide(7, None, ending=True).save is None
