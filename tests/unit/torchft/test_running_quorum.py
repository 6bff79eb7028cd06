"""A joining pipeline reads the running quorum (the lighthouse's status page, the replica ids of its first quorum):
another layout is refused, and a quorum of its own behind live pipelines is asked for again, never trained."""

from __future__ import annotations

import pytest

pytest.importorskip("torchft")

from lightning_spot.layout import LayoutError
from lightning_spot.torchft.replica_group import QuorumError
from lightning_spot.torchft.running_quorum import (
    describe_layout,
    layout_tag,
    layouts_refusal,
    parse_replica_id,
    parse_status,
    parse_tag,
    replica_id,
)
from tests.unit.torchft.conftest import FakeManager, make_group

#: the lighthouse's /status page (torchft 0.2.0) while pipeline 0 (two stages) trains and pipeline 1 is long gone
PAGE = """
Current quorum_id: 7 <br>
Next quorum status: New quorum not ready, only have 0 participants [0/0 participants healthy]
<h3>Previous Quorum</h3>
Previous quorum id: 7 <br>
Num participants: 2 <br>
<div class="member">
  <b>s2c2_pipeline_0:71db80fc-0a04-4e4b-9940-67fe8c98181c</b> <br/>
  Step: 8 <br/>
  Manager: http://vm:36511 <br/>
  TCPStore: 127.0.0.1:29555 <br/>
  World size: 2 <br/>
</div>
<div class="member">
  <b>s2c2_pipeline_1:0a3c0000-0a04-4e4b-9940-67fe8c98181c</b> <br/>
  Step: 7 <br/>
  World size: 2 <br/>
</div>
<h2>Heartbeats</h2>
<ul>
  <li class="heartbeat">s2c2_pipeline_0:71db80fc-0a04-4e4b-9940-67fe8c98181c: seen 82.5ms ago</li>
  <li class="heartbeat old">s2c2_pipeline_1:0a3c0000-0a04-4e4b-9940-67fe8c98181c: seen 12.21s ago</li>
</ul>
"""


def test_the_status_page_gives_the_live_pipelines_steps_and_layouts() -> None:
    running = parse_status(PAGE)
    assert [(m.group, m.layout, m.step, m.world_size, m.live) for m in running.members] == [
        ("0", "s2c2", 8, 2, True),
        ("1", "s2c2", 7, 2, False),
    ]
    assert running.latest_step("1") == 8 and running.latest_step("0") == 0, "live pipelines of other groups only"
    members = [(m.group, m.layout, m.step) for m in running.others("1")]
    assert layouts_refusal(members, "s2c2", "1") is None
    refusal = layouts_refusal(members, layout_tag(1, []), "1")
    assert refusal is not None and "pipeline 1 would train 1 stage(s)" in refusal
    assert "(pipeline 0 at step 8) train 2 stage(s) cut at layers [2]" in refusal
    assert "`--nnodes 2`" in refusal and "pipeline_stages=2, partition=[2]" in refusal
    assert parse_status("<html>a page of another torchft</html>").members == ()


def test_a_joiner_waits_only_for_the_pipelines_that_held_the_latest_step_while_they_heartbeat() -> None:
    """Every pipeline started again at once: the killed ones stay on the page for a few seconds (still "live");
    a joiner stops waiting for their step once their own replica ids no longer heartbeat."""
    holders = parse_status(PAGE).holders("1")
    assert holders == ["s2c2_pipeline_0:71db80fc-0a04-4e4b-9940-67fe8c98181c"]
    assert parse_status(PAGE).any_live(holders)
    later = PAGE.replace("seen 82.5ms ago", "seen 5.2s ago")
    assert not parse_status(later).any_live(holders)
    restarted = PAGE.replace("71db80fc", "9999aaaa")  # (a new process of pipeline 0: another replica id)
    assert not parse_status(restarted).any_live(holders) and parse_status(PAGE).holders("0") == []


def test_a_replica_id_carries_the_layout_and_ends_with_the_group_torchft_reads() -> None:
    from torchft.manager import extract_trailing_digits

    made = replica_id("3", layout_tag(4, [1, 2, 3]))
    assert made == "s4c1.2.3_pipeline_3"
    assert parse_replica_id(f"{made}:9b1f") == ("3", "s4c1.2.3")
    assert extract_trailing_digits(made) == 3, "torchft ranks replicas by the digits that end the id"


def test_a_looped_layout_says_how_many_processes_run_its_stages() -> None:
    """Four stages on four processes and four stages on two (a looped or V-shaped schedule) place the layers on
    different processes: their tags differ, and a tag of one stage per process reads as before."""
    tags = [layout_tag(4, [1, 2, 3]), layout_tag(4, [1, 2, 3], 2), layout_tag(4, [1, 2, 3], 2, "v")]
    assert tags == ["s4c1.2.3", "s4p2c1.2.3", "s4p2vc1.2.3"]
    assert [parse_tag(t) for t in tags] == [
        (4, [1, 2, 3], 4, "loop"),
        (4, [1, 2, 3], 2, "loop"),
        (4, [1, 2, 3], 2, "v"),
    ]
    assert parse_replica_id("s4p2vc1.2.3_pipeline_0:ab") == ("0", "s4p2vc1.2.3")
    assert describe_layout("s4p2c1.2.3") == "4 stage(s) on 2 process(es) cut at layers [1, 2, 3]"
    assert layout_tag(1, [], 1) == "s1c" and parse_tag("s2x") is None


def test_a_quorum_of_its_own_behind_live_pipelines_is_asked_for_again_until_it_takes_their_state(
    fake_torchft: type[FakeManager],
) -> None:
    """The lighthouse formed a quorum of the joiner alone (pipeline 0 was still inside the step that lost a peer):
    it asks again rather than train from step 0, and takes pipeline 0's state when it is in the next quorum."""
    group = make_group([([], 0, False), ([], 0, False), (["s2c2_pipeline_0:x"], 8, True)], fake_torchft)
    try:
        group.join(latest_step=8)
        assert group.manager.asked == 3 and group.healed_state == {"from": "a peer"} and group.step == 8
    finally:
        group.shutdown()


def test_a_quorum_that_never_holds_the_live_pipelines_ends_the_join_with_the_reason(
    fake_torchft: type[FakeManager],
) -> None:
    group = make_group([([], 0, False)], fake_torchft, timeout=0.05)
    try:
        with pytest.raises(QuorumError, match="no quorum with the pipelines that held step 8.*does not start the run"):
            group.join(latest_step=8)
        assert group.manager.stopped, "it stopped heartbeating: the others' quorums do not wait for it"
    finally:
        group.shutdown()


def test_a_quorum_holding_a_pipeline_of_another_layout_is_refused_at_the_join(fake_torchft: type[FakeManager]) -> None:
    """What the status page could not tell (read before another pipeline joined): the quorum's own replica ids. A
    pipeline that would take the state of a peer of other cuts is refused; pipelines of other cuts that start
    together (step 0, nothing to take) train together."""
    group = make_group([(["s1c_pipeline_0:x"], 0, False)], fake_torchft)
    try:
        group.join()
        assert not group.manager.stopped and group.participants == 1
    finally:
        group.shutdown()
    group = make_group([(["s1c_pipeline_0:x"], 8, True)], fake_torchft)
    try:
        with pytest.raises(LayoutError, match=r"pipeline 1 would train 2 stage\(s\) cut at layers \[2\].*pipeline 0\)"):
            group.join()
        assert group.manager.stopped
    finally:
        group.shutdown()
