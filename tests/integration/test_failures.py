"""One rank's error, or a frozen peer, stops every rank of the job within seconds (real processes, gloo).

Each job (``tests/workers/fail_job.py``) trains a P2 pipeline with ``SpotCheckpoint``; one rank fails at a known
step and writes the time. Nothing here kills a rank that is still running until every rank had its chance to end
by itself (``run_until_exit``); the frozen rank is the only one the harness kills.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_spot.preemption import PREEMPTED_EXIT_CODE
from lightning_spot.watchdog import FAILED_EXIT_CODE, PEER_LOST_EXIT_CODE
from tests.distributed import Exits, run_until_exit

#: the issue's bound: every rank has ended this long after the failure
STOP_WITHIN = 5.0


FAILING_RANK = 1  # as in the worker


def run_job(tmp_path: Path, kind: str, world: int = 2) -> tuple[Exits, float]:
    """Run one failing job; every rank not frozen must end within STOP_WITHIN of the first exit anyway."""
    out = tmp_path / kind
    exits = run_until_exit(
        world,
        ["tests/workers/fail_job.py", kind, str(out)],
        log_dir=out / "logs",
        env={"SPOT_TEST_DENIED_RANK": str(FAILING_RANK)},
        timeout=150,
        after_first_exit=2.0 if kind == "freeze" else 8.0,  # a frozen rank never ends: killed after that
    )
    failed = out / "failed.json"
    assert failed.exists(), f"the failure was never reached: {exits.codes}\n" + "\n".join(exits.logs)[-6000:]
    record = json.loads(failed.read_text())
    assert record["rank"] == FAILING_RANK
    return exits, record["time"]


def assert_everyone_stopped(
    exits: Exits, failed_at: float, skip: tuple[int, ...] = (), expect: int = FAILED_EXIT_CODE
) -> None:
    """Every rank ended within the bound, with ``expect``: an error (1) counts against ``lightning-spot run``'s
    --max-failures, a lost or frozen peer (69) is restarted as a preemption (75) is."""
    for rank, (code, when) in enumerate(zip(exits.codes, exits.times)):
        if rank in skip:
            continue
        assert code == expect != PREEMPTED_EXIT_CODE, f"rank {rank} ended with {code}:\n{exits.logs[rank][-4000:]}"
        assert when is not None and when - failed_at < STOP_WITHIN, (rank, when and when - failed_at)


def assert_shown_once(exits: Exits, message: str) -> None:
    """The failing rank shows the traceback; every other rank one line naming it, and no traceback."""
    assert "Traceback (most recent call last)" in exits.logs[FAILING_RANK]
    assert message in exits.logs[FAILING_RANK]
    for rank, log in enumerate(exits.logs):
        if rank != FAILING_RANK:
            assert "Traceback" not in log, log[-4000:]
            assert f"stops because rank {FAILING_RANK} failed" in log and message in log, log[-4000:]


@pytest.mark.timeout(200)
def test_an_error_in_training_step_on_the_last_stage_stops_every_rank(tmp_path: Path) -> None:
    exits, failed_at = run_job(tmp_path, "step")
    assert_everyone_stopped(exits, failed_at)
    assert_shown_once(exits, "ValueError: boom in training_step at step 3")
    assert "in training_step at global step 3" in exits.logs[0]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_an_error_in_a_callback_on_one_rank_stops_the_other_three(tmp_path: Path) -> None:
    exits, failed_at = run_job(tmp_path, "callback", world=4)
    assert_everyone_stopped(exits, failed_at)
    assert_shown_once(exits, "RuntimeError: boom in a callback on rank 1")


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_failed_upload_on_one_rank_stops_every_rank(tmp_path: Path) -> None:
    exits, failed_at = run_job(tmp_path, "upload")
    assert_everyone_stopped(exits, failed_at)
    # torch's checkpoint writer gathers the error: the first rank to report it shows it whole, the other one line
    assert any("access denied writing" in log and "Traceback" in log for log in exits.logs)
    assert any("stops because rank" in log for log in exits.logs)


@pytest.mark.timeout(200)
def test_a_frozen_peer_is_given_up_after_the_step_timeout(tmp_path: Path) -> None:
    exits, frozen_at = run_job(tmp_path, "freeze")
    assert exits.codes[FAILING_RANK] is None  # SIGSTOPped: killed by the harness afterwards
    assert_everyone_stopped(exits, frozen_at, skip=(FAILING_RANK,), expect=PEER_LOST_EXIT_CODE)
    # the worker's step_timeout is 3 s: given up after it, well before the collective timeout (10 minutes)
    assert exits.times[0] is not None and exits.times[0] - frozen_at > 3.0
    assert "no progress for" in exits.logs[0] and "step_timeout" in exits.logs[0]


@pytest.mark.timeout(200)
def test_lightnings_sigterm_stop_on_one_rank_ends_every_rank_at_the_same_step(tmp_path: Path) -> None:
    """Without SpotCheckpoint, Lightning's own SIGTERM stop: rank 1 alone is signalled (Lightning broadcasts only
    rank 0's flag, and blocks every step's start for it); the strategy's agreement ends every rank after the same
    batch, within seconds: the next batch that posts an agreement (these steps are short: every k-th, k <= 8)."""
    from lightning_spot.preemption.coordinate import AgreementCadence

    exits, signalled_at = run_job(tmp_path, "sigterm")
    stopped = [json.loads((tmp_path / "sigterm" / f"stopped-{rank}.json").read_text()) for rank in range(2)]
    assert [s["error"] for s in stopped] == ["SIGTERMException"] * 2, exits.logs
    # signalled during step 3's batch start: agreed at the first posting boundary after it
    assert stopped[0]["step"] == stopped[1]["step"], stopped
    assert 4 <= stopped[0]["step"] <= 4 + AgreementCadence.MOST, stopped
    assert exits.codes == [0, 0], "Lightning's SIGTERM stop is a SystemExit: a clean end, as in plain Lightning"
    for rank, when in enumerate(exits.times):
        assert when is not None and when - signalled_at < STOP_WITHIN, (rank, exits.codes, exits.logs[rank][-3000:])
