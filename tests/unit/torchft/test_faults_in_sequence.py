"""Faults in sequence with three pipelines or more (issue 71), in one process: which ranks serve a joiner cut
otherwise, members of a group that meet before it is configured and give up at once when the quorum broke, a
lighthouse restart seen whatever the new quorum's id, a pipeline's first rank told within milliseconds that another
rank exited, and a failure making the groups of a mixed quorum reported as the step's error."""

from __future__ import annotations

import threading
import time
import types
from typing import Any

import pytest

pytest.importorskip("torchft")

from lightning_spot.torchft.arrival import Arrival, GroupAbandoned
from lightning_spot.torchft.heal_across import serves_unassigned
from lightning_spot.torchft.replica_group import lighthouse_restarted
from tests.distributed import free_port


def _result(**fields: Any) -> Any:
    base = {"heal": False, "recover_dst_replica_ranks": [], "replica_world_size": 3, "max_world_size": 3}
    return types.SimpleNamespace(**{**base, "max_replica_rank": 0, **fields})


def test_every_rank_at_the_newest_step_serves_while_a_member_is_behind() -> None:
    """torchft assigns a joiner one source per stage rank, round-robin from the stage's rank: with three pipelines
    (two at step 20, a joiner at 0), stage 0's source is pipeline A and stage 1's is pipeline B. A joiner cut
    otherwise fetches stage 1's state from A too, so A's rank 1 serves although torchft did not assign it."""
    up_to_date_rank_1_not_assigned = _result(max_world_size=2, max_replica_rank=0)
    assert serves_unassigned(up_to_date_rank_1_not_assigned)
    assert not serves_unassigned(_result(max_world_size=2, recover_dst_replica_ranks=[2])), "torchft serves it"
    assert not serves_unassigned(_result()), "nobody is behind"
    assert not serves_unassigned(_result(max_world_size=2, max_replica_rank=None, heal=True)), "it heals itself"


def test_a_restarted_lighthouse_is_seen_by_a_lower_id_or_the_same_id_with_other_members() -> None:
    """A lighthouse keeps a quorum's id while its members stay: after a restart whose first quorum (id 1) kept its
    three members until the next restart, that one's first quorum is id 1 again, with the pipeline that reached it
    first alone in it."""
    three, one = ("a", "b", "c"), ("b",)
    assert lighthouse_restarted((7, three), (1, three))
    assert lighthouse_restarted((1, three), (1, one))
    assert not lighthouse_restarted((1, three), (1, three)), "the same quorum"
    assert not lighthouse_restarted((1, three), (2, one)), "a pipeline left: a new quorum, numbered higher"
    assert not lighthouse_restarted((None, ()), (1, one)), "the first quorum"


class _Store:
    """A TCPStore on a free port, for members meeting under prefixes of ``host:port/prefix``."""

    def __init__(self) -> None:
        from datetime import timedelta

        from torch.distributed import TCPStore

        self.port = free_port()
        self.server = TCPStore("127.0.0.1", self.port, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=10))  # fmt: skip

    def addr(self, prefix: str) -> str:
        return f"127.0.0.1:{self.port}/{prefix}"


def _meet_in_threads(arrival: Arrival, addr: str, ranks: list[int], size: int) -> dict[int, Any]:
    """Each of ``ranks`` meets at ``addr`` in a thread; their outcomes (None: met) and how long each took."""
    out: dict[int, Any] = {}

    def member(rank: int) -> None:
        started = time.monotonic()
        try:
            arrival.meet(addr, rank, size)
            out[rank] = (None, time.monotonic() - started)
        except GroupAbandoned as err:
            out[rank] = (err, time.monotonic() - started)

    threads = [threading.Thread(target=member, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out


def test_members_meet_and_one_that_gives_up_or_a_broken_quorum_ends_the_wait_at_once() -> None:
    store = _Store()
    arrival = Arrival(alive=lambda: True, timeout=20.0, connect_timeout=3.0)
    met = _meet_in_threads(arrival, store.addr("q1/s5/0-2-4/meet"), [0, 1, 2], 3)
    assert all(err is None for err, _ in met.values()), met
    # one member gives up (its heal failed): the two waiting learn it within a poll, not at the 20 s timeout
    addr = store.addr("q2/s5/0-2-4/meet")
    threading.Timer(0.3, arrival.abandon, args=(addr, "pipeline 1 rank 0: its heal failed")).start()
    waited = _meet_in_threads(arrival, addr, [0, 2], 3)
    assert all(isinstance(err, GroupAbandoned) and "its heal failed" in str(err) for err, _ in waited.values())
    assert max(took for _, took in waited.values()) < 5.0, waited
    # a member that never comes while its pipeline stopped heartbeating: given up at the next look at the quorum
    broken = Arrival(alive=lambda: False, timeout=20.0, connect_timeout=3.0)
    waited = _meet_in_threads(broken, store.addr("q3/s5/0-2-4/meet"), [0, 1], 3)
    assert all("stopped heartbeating" in str(err) for err, _ in waited.values())
    assert max(took for _, took in waited.values()) < 5.0, waited
    # nothing says so: the timeout bounds the wait, and names who did not come
    short = Arrival(alive=lambda: True, timeout=0.5, connect_timeout=3.0)
    ((err, _),) = _meet_in_threads(short, store.addr("q4/s5/0-2-4/meet"), [1], 3).values()
    assert isinstance(err, GroupAbandoned) and "members ['0', '2'] of 3 did not come within 0 s" in str(err)


def test_a_store_that_is_gone_abandons_the_group_within_the_connect_timeout() -> None:
    arrival = Arrival(alive=lambda: True, timeout=20.0, connect_timeout=0.5)
    started = time.monotonic()
    with pytest.raises(GroupAbandoned, match="the quorum's store at 127.0.0.1:.* is gone"):
        arrival.meet(f"127.0.0.1:{free_port()}/q1/meet", 0, 2)
    assert time.monotonic() - started < 10.0
    arrival.abandon(f"127.0.0.1:{free_port()}/q1/meet", "nothing to tell")  # (no store: no error)


def test_a_pipeline_whose_beats_stopped_is_seen_on_the_lighthouse_page() -> None:
    """Half a second without a beat (five missed) is a pipeline gone; one the page does not list is not known to be
    gone (a lighthouse that restarted has not heard from it yet)."""
    from lightning_spot.torchft.running_quorum import parse_status
    from tests.unit.torchft.test_running_quorum import PAGE

    live, gone = (
        "s2c2_pipeline_0:71db80fc-0a04-4e4b-9940-67fe8c98181c",
        "s2c2_pipeline_1:0a3c0000-0a04-4e4b-9940-67fe8c98181c",
    )
    running = parse_status(PAGE)
    assert running.stopped([live, gone, "s1c_pipeline_2:new"]) == [gone]
    assert parse_status(PAGE.replace("seen 82.5ms ago", "seen 612ms ago")).stopped([live]) == [live]


def test_a_joiner_whose_ranks_did_not_all_take_a_peers_state_leaves_whole(
    fake_torchft: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 took a peer's state, rank 0's source left mid-transfer (D2): rank 1 would go on into the pipeline's
    first collective while rank 0 asked the lighthouse again, both waiting with no timeout. The ranks agree first,
    and leave together (exit 75: their agent starts them again, and they rejoin whole)."""
    from lightning_spot.torchft import replica_group
    from lightning_spot.torchft.replica_group import StageModel
    from tests.unit.torchft.conftest import make_group

    group = make_group([(["s2c2_pipeline_0:x"], 8, True)], fake_torchft)
    group.model = StageModel(module=None, split=None, plan=None, group=object())
    monkeypatch.setattr(replica_group, "all_gather_object", lambda mine, group: [False, mine])
    exits: list[int] = []

    def leave(code: int) -> None:
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(replica_group.os, "_exit", leave)
    try:
        with pytest.raises(SystemExit):
            group.join(latest_step=8)
        assert exits == [75] and group.manager.stopped, "it left the quorum and exited for its agent to restart it"
    finally:
        group.shutdown()


def test_groups_a_mixed_quorum_could_not_make_are_the_steps_error_not_a_crash(
    fake_torchft: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member of a quorum of mixed cuts gone while the groups are made (D3: a notice on another pipeline crashed a
    healthy one with DistNetworkError from the configure): the error is reported to torchft (the step does not
    commit, and is run again with the next quorum), and every reduction of that quorum fails with it."""
    from lightning_spot.torchft import replica_group
    from lightning_spot.torchft.mixed_quorum import BrokenReduce
    from lightning_spot.torchft.replica_group import StageModel
    from tests.unit.torchft.conftest import make_group

    group = make_group([([], 0, False)], fake_torchft)
    group.manager_rank = 0  # (the pipeline's first rank hands the quorum's store to the others)
    reported: list[BaseException] = []
    group.manager.report_error = reported.append  # type: ignore[attr-defined]
    group.model = StageModel(module=None, split=None, plan=None, group=None)
    group.buckets = types.SimpleNamespace(params=[])  # type: ignore[assignment]
    group._client.last = types.SimpleNamespace(  # type: ignore[union-attr]
        replica_ids=["s2c2_pipeline_1:me", "s1c_pipeline_0:x"], store_address="127.0.0.1:1", quorum_id=4, max_step=9
    )
    monkeypatch.setattr(replica_group, "quorum_plans", lambda ids, split: ["plan", "plan"])

    def groups_fail(*args: Any, pg: Any, **kwargs: Any) -> Any:
        return pg("0-1", 0, 2)  # (the first group's members meet: the quorum's store is gone)

    monkeypatch.setattr(replica_group, "HolderReduce", groups_fail)
    try:
        group._use_mixed()
        assert isinstance(group._mixed, BrokenReduce) and len(reported) == 1, reported
        assert isinstance(reported[0], GroupAbandoned) and "store at 127.0.0.1:1 is gone" in str(reported[0])
        with pytest.raises(GroupAbandoned):
            group._mixed.reduce(1.0)
    finally:
        group.shutdown()
