"""Intervals chosen for the user: snapshots within an overhead budget, durable saves at the Young-Daly interval
from the measured cost and the run's interruption rate (read from its history), explicit arguments winning."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lightning_spot.checkpoint.cadence import (
    MIN_SECONDS,
    MTBF_PRIOR_SECONDS,
    SNAPSHOT_BUDGET,
    Cadence,
)
from lightning_spot.checkpoint.durable.journal import RUNNING_GAP_SECONDS, interruption_history
from lightning_spot.checkpoint.durable.storage import Storage
from lightning_spot.checkpoint.loop_cost import LoopSteps


def chosen(**kwargs: object) -> Cadence:
    args = {"snapshot_steps": None, "snapshot_seconds": None, "durable_steps": None, "durable_minutes": None}
    return Cadence(**{**args, "snapshots": True, **kwargs})  # type: ignore[arg-type]


def test_snapshots_are_as_frequent_as_the_budget_allows() -> None:
    cadence = chosen()
    assert cadence.snapshot_every() == MIN_SECONDS  # the first one soon, to measure
    cadence.observe_snapshot(cost=0.05, wall=0.2)
    assert cadence.snapshot_every() == MIN_SECONDS, "the second soon too: the first paid one-time costs"
    cadence.observe_snapshot(cost=0.05, wall=0.2)
    assert cadence.snapshot_every() == pytest.approx(0.05 / SNAPSHOT_BUDGET)  # 5 s: 1% of the loop
    for cost in (0.02, 0.02, 0.02, 0.02):  # the median of the recent ones counts
        cadence.observe_snapshot(cost=cost, wall=0.2)
    assert cadence.snapshot_every() == pytest.approx(2.0)
    cadence.observe_snapshot(cost=0.02, wall=3.0)
    cadence.observe_snapshot(cost=0.02, wall=3.0)
    cadence.observe_snapshot(cost=0.02, wall=3.0)
    assert cadence.snapshot_every() == pytest.approx(6.0), "never more often than twice the write takes"


def test_the_first_snapshot_and_durable_save_stop_counting_once_a_second_is_measured() -> None:
    """The first of a run page-locks its host buffers on a GPU (one H200: 4.7 s for 5.4 GB, then 0.1 s a save):
    the mean of the two would space snapshots 25x too far apart."""
    cadence = chosen()
    cadence.observe_snapshot(cost=4.7, wall=2.0)
    assert cadence.snapshot_every() == pytest.approx(4.0), "the second soon, once the first's write is done twice over"
    assert "the second measures again" in cadence.describe()
    cadence.observe_snapshot(cost=0.1, wall=2.0)
    assert cadence.snapshot_every() == pytest.approx(10.0)
    cadence.observe_snapshot(cost=0.3, wall=2.0)
    assert cadence.snapshot_every() == pytest.approx(20.0), "the median of the later ones"
    cadence.observe_durable(cost=4.8, wall=5.0)
    cadence.observe_durable(cost=0.2, wall=5.0)
    assert cadence.durable_cost() == pytest.approx(0.2)


def test_the_choice_is_said_once_it_rests_on_steady_measurements_and_again_only_when_it_moves_much() -> None:
    """The demo's 20 s run said three differently worded interval lines: after the first snapshot (its one-time
    costs), after the second, after the first durable save. Now: nothing on a first measurement alone; one line
    once both kinds rest on steady ones; another only when an interval moves by more than a factor of 2."""
    cadence, said = chosen(), (None, None)
    cadence.observe_snapshot(cost=0.042, wall=0.01)
    assert cadence.worth_saying(said) is None, "the first snapshot paid one-time costs: the second measures again"
    cadence.observe_snapshot(cost=0.0096, wall=0.01)
    said = cadence.worth_saying(said)  # type: ignore[assignment]
    assert said is not None and said[0] == max(MIN_SECONDS, 0.0096 / SNAPSHOT_BUDGET)
    assert said[1] == pytest.approx(math.sqrt(2 * 0.0096 * MTBF_PRIOR_SECONDS)), "durable saves cost a snapshot"
    cadence.observe_snapshot(cost=0.014, wall=0.01)
    assert cadence.worth_saying(said) is None, "1.4 s instead of 1 s: within a factor of 2"
    cadence.observe_durable(cost=0.121, wall=0.05)
    assert cadence.worth_saying(said) is None, "the first durable save paid one-time costs too"
    cadence.observe_durable(cost=0.02, wall=0.05)
    assert cadence.worth_saying(said) is None, "the second costs about what a snapshot did"
    cadence.observe_durable(cost=0.5, wall=0.05)
    cadence.observe_durable(cost=0.5, wall=0.05)
    moved = cadence.worth_saying(said)
    assert moved is not None and moved[1] == pytest.approx(math.sqrt(2 * 0.5 * MTBF_PRIOR_SECONDS))
    assert moved[0] == pytest.approx(0.0118 / SNAPSHOT_BUDGET), "(the snapshots: the median of the steady ones)"


def test_durable_saves_follow_young_daly_with_the_runs_own_interruption_rate() -> None:
    cadence = chosen()
    cadence.observe_durable(cost=0.5, wall=1.0)
    prior = math.sqrt(2 * 0.5 * MTBF_PRIOR_SECONDS)  # no history: one prior interval of an hour
    assert cadence.durable_every() == pytest.approx(prior)
    cadence.set_history(exposure_seconds=3 * 3600.0, interruptions=7)  # interrupted every ~32 minutes so far
    mtbf = (3 * 3600.0 + MTBF_PRIOR_SECONDS) / 8
    assert cadence.mtbf_seconds == pytest.approx(mtbf)
    assert cadence.durable_every() == pytest.approx(math.sqrt(2 * 0.5 * mtbf))
    assert math.sqrt(2 * 0.5 * mtbf) < prior
    cadence.set_history(exposure_seconds=100 * 3600.0, interruptions=0)  # a quiet run saves less often
    assert cadence.durable_every() > prior
    assert "Young-Daly" in cadence.describe() and "0 interruption" not in cadence.describe()


def test_a_durable_save_before_any_is_measured_costs_what_a_snapshot_costs() -> None:
    cadence = chosen()
    cadence.observe_snapshot(cost=0.08, wall=0.1)
    assert cadence.durable_cost() == pytest.approx(0.08)
    cadence.observe_durable(cost=0.2, wall=0.5)
    assert cadence.durable_cost() == pytest.approx(0.2)


def test_explicit_intervals_win() -> None:
    cadence = chosen(snapshot_steps=5, durable_steps=20)
    assert cadence.snapshot_every() is None and cadence.durable_every() is None and not cadence.timed
    assert chosen(snapshot_seconds=7.0).snapshot_every() == 7.0
    assert chosen(durable_minutes=2.0).durable_every() == 120.0
    assert chosen(snapshots=False).snapshot_every() is None
    assert chosen(snapshots=False).durable_every() is not None, "durable saves are still chosen"


def test_the_interruption_history_comes_from_the_event_names(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path))
    t0 = 1_700_000_000.0

    def event(seconds: float, kind: str) -> None:
        storage.write_json(f"events/{int((t0 + seconds) * 1e9):020d}-{kind}.json", {"kind": kind})

    assert interruption_history(storage) == (0.0, 0)
    event(0, "start")
    event(30, "progress")
    event(60, "progress")  # killed after this
    event(100, "start")  # restarted 40 s later
    event(130, "preempted")
    event(3600, "start")  # down for an hour: not running time
    event(3630, "end")
    event(90000, "start")  # the user started it again the next day: not an interruption
    exposure, interruptions = interruption_history(storage)
    assert interruptions == 2
    assert exposure == pytest.approx(130 + RUNNING_GAP_SECONDS + 30 + RUNNING_GAP_SECONDS)


def test_no_snapshots_and_a_snapshot_interval_together_are_refused() -> None:
    """They contradict each other: the interval used to win silently."""
    from lightning_spot import SpotCheckpoint

    with pytest.raises(ValueError, match=r"snapshots=False, snapshot_every_n_train_steps=.*drop snapshot_every_n"):
        SpotCheckpoint(snapshots=False, snapshot_every_n_train_steps=5)
    with pytest.raises(ValueError, match="snapshot_every_n_seconds"):
        SpotCheckpoint(snapshots=False, snapshot_every_n_seconds=30)
    assert not SpotCheckpoint(snapshots=False).cadence.snapshots
    assert SpotCheckpoint(snapshot_every_n_train_steps=5).cadence.snapshots


def run_cadence(step_seconds: list[float], monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The boundaries (1-based) at which an AgreementCadence posts, one rank, steps of the given durations."""
    from lightning_spot.preemption import coordinate

    now = [100.0]
    monkeypatch.setattr(coordinate.time, "monotonic", lambda: now[0])
    cadence = coordinate.AgreementCadence()
    posted = []
    for boundary, seconds in enumerate(step_seconds, 1):
        if cadence.due():
            posted.append(boundary)
            # one rank (no process group): its own proposal is the smallest
            assert cadence.read(cadence.post([3.0], torch.device("cpu"))) == [3.0]
        now[0] += seconds
    return posted


def test_agreements_thin_out_on_short_steps_and_stay_on_every_step_of_slow_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lightning_spot.preemption.coordinate import AgreementCadence

    # 10 ms steps: every boundary at first, then at most twice as far apart each time, up to MOST
    assert run_cadence([0.01] * 40, monkeypatch) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert AgreementCadence.MOST == 8
    # 0.1 s steps: two fit in the 0.25 s window
    assert run_cadence([0.1] * 10, monkeypatch) == [1, 2, 4, 6, 8, 10]
    # steps longer than the window: every boundary, as before
    assert run_cadence([0.3] * 6, monkeypatch) == [1, 2, 3, 4, 5, 6]
    # steps that slow down: the interval shrinks at the next agreement
    assert run_cadence([0.01] * 8 + [0.5] * 8, monkeypatch) == [1, 2, 4, 8, 16]


def test_every_rank_takes_the_smallest_proposal() -> None:
    """The proposal is negated: the agreement's maximum is the smallest interval any rank proposed."""
    from lightning_spot.preemption.coordinate import AgreementCadence

    fast, slow = AgreementCadence(), AgreementCadence()
    fast.every = slow.every = 4
    agreed = max(-8.0, -2.0)  # one rank proposes 8, another 2
    fast.agreed(agreed)
    slow.agreed(agreed)
    assert fast.every == slow.every == 2


def _loop(durations: list[float]) -> LoopSteps:
    """The loop's steps back to back from t=0, each ``durations[i]`` long, with 1 ms of our hook between them."""
    loop, t = LoopSteps(), 0.0
    for d in durations:
        loop.back_to_training(t)
        loop.step_ended(t + d)
        t += d + 0.001
    return loop


def test_a_background_write_costs_the_loop_what_the_steps_it_overlaps_take_beyond_the_usual() -> None:
    # 20 steps of 100 ms, then 10 of 110 ms while the write runs (t = 2.02 .. 3.13): 10 ms x 10 steps
    loop = _loop([0.1] * 20 + [0.11] * 10 + [0.1] * 5)
    assert loop.cost(2.02, 3.13) == pytest.approx(0.1, rel=0.02)
    # a write the loop did not notice costs nothing, however much CPU it took (a GPU host with cores to spare)
    assert _loop([0.1] * 35).cost(2.02, 3.13) == pytest.approx(0.0, abs=1e-9)
    # one slow step among the overlapped ones (a validation run) does not count for all of them
    assert _loop([0.1] * 20 + [0.1] * 4 + [2.0] + [0.1] * 5).cost(2.02, 5.0) == pytest.approx(0.0, abs=1e-9)
    # written within SpotCheckpoint's own hook (no step overlaps it): its stall is all it cost
    assert _loop([0.1] * 20).cost(1.9995, 1.9998) == 0.0


def test_a_write_without_clean_steps_before_it_is_not_measured_on_the_steps() -> None:
    assert _loop([0.1] * 2 + [0.2] * 5).cost(0.21, 0.9) is None  # two steps before it: no baseline
    loop = _loop([0.1] * 20 + [0.11] * 10)
    # an earlier write still running since t=0.15 overlapped all but the first step: no usual steps to compare with
    assert loop.cost(2.02, 3.13, running=[0.15]) is None
    assert loop.cost(2.02, 3.13) == pytest.approx(0.1, rel=0.02)


def test_a_snapshot_by_the_clock_waits_for_the_previous_write_rather_than_stalling_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Snapshots due every 50 ms, each written in 0.8 s: one by the clock is postponed (by every rank alike) until
    the previous one is written; taken anyway, its copy would wait for that write on the training thread (on the
    H200, 3.8 s per snapshot of a 5.4 GB state)."""
    import time

    import lightning as L

    from lightning_spot import SpotCheckpoint
    from lightning_spot.checkpoint import step_policy
    from lightning_spot.checkpoint.memory.snapshotter import Snapshotter
    from tests.models import fit_in_this_process, make_loader, make_model

    store = Snapshotter._store

    def slow_store(self: Snapshotter, *args: object) -> bool:
        time.sleep(0.8)
        return store(self, *args)  # type: ignore[arg-type]

    class SlowSteps(L.Callback):
        def on_train_batch_end(self, *args: object) -> None:
            time.sleep(0.03)

    monkeypatch.setattr(Snapshotter, "_store", slow_store)
    # warned of from 0.2 s while the write lasts 0.8 s: a window far wider than the ~0.25 s between agreements
    monkeypatch.setattr(step_policy, "POSTPONED_WARN_SECONDS", 0.2)
    spot = SpotCheckpoint(
        str(tmp_path / "run"),
        snapshot_dir=str(tmp_path / "shm"),
        snapshot_every_n_seconds=0.05,
        every_n_train_steps=1000,
        preemption=False,
    )
    fit_in_this_process(tmp_path, make_model(), make_loader(), max_steps=50, callbacks=[SlowSteps(), spot])
    summary = spot.summary()
    assert summary["snapshots"] >= 2, "snapshots were taken, each once the previous one was written"
    assert summary["snapshot_stall_seconds"] < 0.25, "no snapshot's copy waited for the previous write"
    assert summary["snapshot_wait_seconds"] < 0.1
    postponed = [r.getMessage() for r in caplog.records if "still writing the previous one" in r.getMessage()]
    assert len(postponed) == 1, "a long wait is said, once"
