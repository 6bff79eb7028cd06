"""The spot simulator (``benchmarks/spot_simulator.py``): hand-computed runs, the calibration inputs taken from
a replay's figures, and the Oobleck case's setting."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.spot_simulator import (
    Policy,
    Recovery,
    oobleck_case,
    recovery_from_replays,
    replay_inputs,
    simulate,
)

RECOVERY = Recovery(
    stop_s=1.0,
    join_restart_s=2.0,
    leave_restart_s=3.0,
    detect_s=4.0,
    setup_s=5.0,
    restore_memory_s=0.5,
    restore_storage_s=10.0,
    first_step_s=0.5,
)


def speed(n: int) -> float | None:
    """1 s per step on 2 nodes, 2 s on 1, nothing fits on 0."""
    return {1: 2.0, 2: 1.0}.get(n) if n > 0 else None


def test_an_uninterrupted_run_is_all_useful() -> None:
    out = simulate([(0.0, 2, None)], speed, RECOVERY, steps=30)
    assert out.wall_s == pytest.approx(30.0) and out.share == pytest.approx(1.0) and out.restarts == 0


def test_a_leave_with_notice_costs_the_stop_and_the_restart_and_loses_no_step() -> None:
    out = simulate([(0.0, 2, None), (10.0, -1, True)], speed, RECOVERY, steps=20)
    down = 1.0 + 3.0 + 5.0 + 0.5 + 0.5  # stop, restart, setup, restore from memory, first step
    assert out.wall_s == pytest.approx(10 + down + 10 * 2.0)
    assert out.useful_s == pytest.approx(10 * 1.0 + 10 * 2.0) and out.steps_lost == 0
    assert out.restarts == 1 and out.from_storage == 0 and out.down_s == pytest.approx(down)


def test_a_kill_loses_the_steps_since_the_newest_snapshot() -> None:
    policy = Policy(snapshot_every=4, checkpoint_every=20)
    out = simulate([(0.0, 2, None), (10.5, -1, False)], speed, RECOVERY, policy, steps=20)
    assert out.steps_lost == pytest.approx(2.5), "back to the snapshot of step 8"
    down = 4.0 + 5.0 + 0.5 + 0.5
    assert out.wall_s == pytest.approx(10.5 + down + 12 * 2.0)
    assert out.useful_s == pytest.approx(8 * 1.0 + 12 * 2.0)


def test_two_nodes_killed_at_once_fall_back_to_storage() -> None:
    policy = Policy(snapshot_every=1, checkpoint_every=5, memory_survives_kills=1)
    events = [(0.0, 3, None), (12.5, -2, False)]
    out = simulate(events, lambda n: 1.0 if n else None, RECOVERY, policy, steps=20)
    assert out.from_storage == 1 and out.steps_lost == pytest.approx(2.5), "back to the durable step 10"
    assert out.wall_s == pytest.approx(12.5 + 4.0 + 5.0 + 10.0 + 0.5 + 10.0)
    lenient = simulate(events, lambda n: 1.0 if n else None, RECOVERY, Policy(memory_survives_kills=2), steps=20)
    assert lenient.from_storage == 0 and lenient.steps_lost == pytest.approx(0.5)


def test_a_change_during_a_restart_redoes_it_and_too_few_nodes_idle() -> None:
    events = [(0.0, 2, None), (10.0, -1, True), (12.0, 1, None)]
    out = simulate(events, speed, RECOVERY, steps=20)
    assert out.restarts == 1, "the join falls inside the leave's restart: one restart, redone"
    assert out.wall_s == pytest.approx(12.0 + 2.0 + 5.0 + 0.5 + 0.5 + 10 * 1.0)
    idle = simulate([(0.0, 2, None), (10.0, -2, True), (30.0, 2, None)], speed, RECOVERY, steps=20)
    assert idle.idle_s == pytest.approx(20.0), "no node from 10 s to 30 s"
    assert idle.from_storage == 1, "every node left: the state comes back from the durable checkpoint"
    assert idle.wall_s == pytest.approx(30.0 + 2.0 + 5.0 + 10.0 + 0.5 + 10.0) and idle.steps_lost == 0


def _replay() -> dict[str, Any]:
    """What spot_replay.py --json writes, cut to what the simulator reads."""
    attempt = {"layout_detail": {"world_size": 2}, "steps_per_second": 4.0, "last_step": 40}
    return {
        "epoch": 1000.0,
        "config": {"snapshot_every": 1, "every": 5},
        "events": [
            {"time": 0.0, "event": "join", "nodes": 1},
            {"time": 0.0, "event": "join", "nodes": 2},
            {"time": 5.0, "event": "join", "nodes": 3},
            {"time": 20.0, "event": "leave", "notice": True, "nodes": 2},
            {"time": 40.0, "event": "leave", "notice": False, "nodes": 1},
        ],
        "report": {
            "started_epoch": 1008.0,  # training started 8 s into the replay
            "useful_time_share": 0.5,
            "wall_seconds": 60.0,
            "restarts": [{}, {}],
            "attempts": [
                attempt,
                {**attempt, "layout_detail": {"pipeline_stages": 1, "data_parallel": 1}, "steps_per_second": 2.0},
            ],
        },
        "phases": [
            {
                "event": "leave (notice)",
                "phases": {"stop": 0.2, "restart": 14.0, "setup": 4.0, "restore": 0.01, "first_step": 0.05},
                "after_kill": None,
            },
            {
                "event": "leave (kill)",
                "phases": {"stop": None, "restart": 16.0, "setup": 5.0, "restore": 0.03, "first_step": 0.05},
                "after_kill": 15.0,
            },
        ],
    }


def test_calibration_reads_the_measured_phases_steps_and_events() -> None:
    recovery = recovery_from_replays([_replay()], fallback=RECOVERY)
    assert recovery.stop_s == pytest.approx(0.2) and recovery.leave_restart_s == pytest.approx(14.0)
    assert recovery.detect_s == pytest.approx(15.0), "after a kill: from the kill, not from the last record"
    assert recovery.setup_s == pytest.approx(4.5) and recovery.restore_memory_s == pytest.approx(0.02)
    assert recovery.join_restart_s == RECOVERY.join_restart_s, "no join measured: the fallback's"
    with pytest.raises(ValueError, match="no restart after a join"):
        recovery_from_replays([_replay()])
    events, seconds, steps = replay_inputs(_replay())
    # the first attempt's 2 nodes at 0; a join during its set-up restarts it at once
    assert events == [(0.0, 1, None), (0.0, 1, None), (1e-6, 1, None), (12.0, -1, True), (32.0, -1, False)]
    assert seconds == {2: 0.25, 1: 0.5} and steps == 40


def test_the_oobleck_case_is_their_setting() -> None:
    case = oobleck_case(RECOVERY)
    out = case["outcome"]
    assert out["wall_s"] == pytest.approx(9000.0), "2.5 hours"
    assert out["restarts"] == 14 and out["from_storage"] == 0, "one kill every 601.2 s, from 30 nodes on"
    assert 0.5 < case["share"] < 1.0
    assert case["published"] == {"Oobleck": 0.955, "Varuna": 0.544, "Bamboo": 0.150}


def test_a_large_case_compares_memory_and_storage_recovery() -> None:
    """The planner's step times for a small GPT on 4 nodes x 2 devices losing a node every 10 minutes (kills and
    notices alternate): snapshots in memory lose fewer steps and restart faster than object storage alone."""
    from benchmarks.spot_simulator import GPT, large_case
    from benchmarks.spot_traces import fixed_rate

    model = GPT(layers=4, hidden=64, sequence=32, vocab=100)
    case = large_case(fixed_rate(4, 600, 3600), RECOVERY, nodes=4, gpus_per_node=2, global_batch=16, model=model)
    memory, storage = case["paths"]["memory"], case["paths"]["storage"]
    assert memory["outcome"]["restarts"] == storage["outcome"]["restarts"] == 2  # the third loss ends the trace
    assert memory["outcome"]["from_storage"] == 0 and storage["outcome"]["from_storage"] >= 1
    assert memory["outcome"]["steps_lost"] < storage["outcome"]["steps_lost"]
    assert 0 < storage["share"] < memory["share"] < 1
    assert case["step_seconds_at_peak"] > 0 and "P" in case["layout_at_peak"]


def test_survivors_ride_through_a_kill_and_a_join_with_torchft() -> None:
    """fault_tolerant: a kill with a node left costs ft_leave_s and half a step (the step in flight, run again), no
    restart and no step lost; a node that joins starts beside the run and stalls it ft_join_s when it joins."""
    ft = Policy(snapshot_every=0, fault_tolerant=True)
    out = simulate([(0.0, 2, None), (10.5, -1, False)], speed, RECOVERY, ft, steps=20)
    stall = RECOVERY.ft_leave_s + 1.0 / 2  # the lost pipeline's heartbeat, then the step in flight run again
    assert out.restarts == 0 and out.steps_lost == 0 and out.quorum_changes == 1
    assert out.wall_s == pytest.approx(10.5 + stall + (20 - 10.5) * 2.0)
    joined = 20.0 + RECOVERY.join_restart_s + RECOVERY.setup_s + RECOVERY.restore_memory_s  # its own start-up
    out = simulate([(0.0, 1, None), (20.0, 1, None)], speed, RECOVERY, ft, steps=20)
    done = joined / 2.0  # steps at 2 s each until the joiner is in
    assert out.restarts == 0 and out.quorum_changes == 1
    assert out.wall_s == pytest.approx(joined + RECOVERY.ft_join_s + (20 - done) * 1.0)
    assert simulate([(0.0, 1, None), (5.0, -1, False), (6.0, 1, None)], speed, RECOVERY, ft, steps=5).restarts == 1


def linear(n: int) -> float | None:
    """A step of 8 node-seconds: 1 s on 8 nodes, 2 s on 4; 4 nodes at least (the model's memory)."""
    return 8.0 / n if n >= 4 else None


def test_gpu_time_efficiency_charges_the_nodes_up_that_do_not_train() -> None:
    """Samples trained against the node-seconds up at the full cluster's per-node speed: 1 without events; with
    torchft and pipelines of 4 nodes, a node lost for good idles the 3 others of its pipeline (2 pipelines of 4 train
    on 4 of the 7 nodes left); pipelines of one node keep all 7 training."""
    assert simulate([(0.0, 8, None)], linear, RECOVERY, steps=30).gpu_time_efficiency == pytest.approx(1.0)
    events = [(0.0, 8, None), (10.0, -1, False)]
    stall = RECOVERY.ft_leave_s + 0.5  # the heartbeat, half a step of 1 s run again
    deep = simulate(
        events, linear, RECOVERY, Policy(snapshot_every=0, fault_tolerant=True, pipeline_nodes=4), until_s=100
    )
    assert deep.restarts == 0 and deep.quorum_changes == 1 and deep.per_nodes.keys() == {8, 4}
    assert deep.steps == pytest.approx(10 + (100 - 10 - stall) / 2.0)
    assert deep.node_s == pytest.approx(8 * 10 + 7 * 90) and deep.idle_node_s == pytest.approx(3 * 90)
    assert deep.gpu_time_efficiency == pytest.approx(deep.steps * 1.0 * 8 / deep.node_s)
    flat = simulate(events, linear, RECOVERY, Policy(snapshot_every=0, fault_tolerant=True), until_s=100)
    assert flat.steps == pytest.approx(10 + (100 - 10 - stall) / (8 / 7))
    assert flat.idle_node_s == 0 and flat.gpu_time_efficiency == pytest.approx(flat.steps * 8 / flat.node_s)
    assert deep.share == pytest.approx(flat.share), "the useful-time share cannot tell the two apart"
    assert deep.gpu_time_efficiency < 0.65 < 0.95 < flat.gpu_time_efficiency
    # the node comes back: it completes the broken pipeline, which joins after its own start-up
    back = simulate(
        [*events, (50.0, 1, None)],
        linear,
        RECOVERY,
        Policy(snapshot_every=0, fault_tolerant=True, pipeline_nodes=4),
        until_s=100,
    )
    assert back.quorum_changes == 2 and back.node_s == pytest.approx(8 * 10 + 7 * 40 + 8 * 50)
    assert back.gpu_time_efficiency > deep.gpu_time_efficiency


def test_survivors_that_re_form_train_again_after_the_re_form() -> None:
    """Policy(reform_s=5): the 3 survivors of a broken 4-node pipeline idle 5 s, then train at a smaller depth (all
    7 nodes train); without it they idle to the end."""
    events = [(0.0, 8, None), (10.0, -1, False)]
    ft = {"snapshot_every": 0, "fault_tolerant": True, "pipeline_nodes": 4}
    waiting = simulate(events, linear, RECOVERY, Policy(**ft), until_s=100)
    reformed = simulate(events, linear, RECOVERY, Policy(**ft, reform_s=5.0), until_s=100)
    assert reformed.idle_node_s == pytest.approx(3 * 5.0) and waiting.idle_node_s == pytest.approx(3 * 90)
    assert reformed.quorum_changes == 2 and reformed.per_nodes.keys() == {8, 4, 7}
    assert waiting.gpu_time_efficiency < 0.65 < 0.95 < reformed.gpu_time_efficiency
