"""``lightning-spot run``'s agent in one process: what counts as an error, a node that left, its flags and heartbeat."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import pytest

from tests.distributed import free_port


def test_what_counts_as_an_error() -> None:
    from lightning_spot_launch.failures import is_error

    assert is_error([1]) and is_error([69, 1]) and is_error([2])
    assert not is_error([75]) and not is_error([69]) and not is_error([-9, 69]) and not is_error([0, None])


def test_a_node_that_left_is_not_waited_for() -> None:
    """Two nodes complete a round; one leaves (as after a notice); the other's next round completes within its
    last call instead of waiting 30 s for the leaver's heartbeats to expire (its join times out at 10 s)."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from lightning_spot_launch import rendezvous

    port = free_port()

    def handler():
        params = RendezvousParameters(
            backend="c10d",
            endpoint=f"127.0.0.1:{port}",
            run_id="leave-test",
            min_nodes=1,
            max_nodes=2,
            join_timeout="10",
            last_call_timeout="1",
            keep_alive_interval="10",
            keep_alive_max_attempt="3",
        )
        return rendezvous._create(params)

    stay, go = handler(), handler()
    rounds = [threading.Thread(target=h.next_rendezvous) for h in (stay, go)]
    for t in rounds:
        t.start()
    for t in rounds:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in rounds)
    assert rendezvous.leave([go])
    start = time.monotonic()
    info = stay.next_rendezvous()  # raises RendezvousTimeoutError after 10 s if it waited for the leaver
    assert info.world_size == 1 and time.monotonic() - start < 8
    stay.shutdown()
    # drop the handlers and their stores: the store's server threads outliving the test made a process forked
    # later in this one (a DataLoader worker) hang when it exited, for 30 s
    rendezvous._handlers.clear()
    del stay, go
    gc.collect()


@pytest.mark.parametrize("flag", ["--fresh-processes", None])
def test_run_passes_the_launcher_flags(flag: str | None, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_spot.cli import main

    extra = [flag] if flag else ["--preload", "transformers"]
    assert main(["run", "--dry-run", *extra, "train.py"]) == 0
    line = capsys.readouterr().out
    assert "-m lightning_spot_launch" in line and (flag or "--preload=transformers") in line


def test_run_passes_the_shutdown_timeout_and_the_signals_to_forward(capsys: pytest.CaptureFixture[str]) -> None:
    """What a scheduler's grace period and notice signal need: torchrun's own flags, passed through (and parsed by
    our agent, which takes torchrun's parser)."""
    from torch.distributed.run import get_args_parser

    from lightning_spot.cli import main

    assert main(["run", "--dry-run", "--shutdown-timeout", "80", "--signals-to-handle", "SIGTERM,SIGUSR1", "x.py"]) == 0
    line = capsys.readouterr().out
    assert "--shutdown-timeout=80" in line and "--signals-to-handle=SIGTERM,SIGUSR1" in line
    parsed = get_args_parser().parse_args(["--shutdown-timeout=80", "--signals-to-handle=SIGTERM,SIGUSR1", "x.py"])
    assert parsed.shutdown_timeout == 80 and parsed.signals_to_handle == "SIGTERM,SIGUSR1"
    assert main(["run", "--dry-run", "x.py"]) == 0
    assert "--shutdown-timeout" not in capsys.readouterr().out  # (torchrun's default unless asked)


def test_heartbeat_default_follows_the_node_count(capsys: pytest.CaptureFixture[str]) -> None:
    """1 s beats up to 64 nodes (a dead node given up after 3 s); beyond, torchrun's 5 s spare the store."""
    from lightning_spot.cli import main

    for nnodes, beat in (("1:4", 1), ("64", 1), ("1:128", 5)):
        assert main(["run", "--dry-run", "--nnodes", nnodes, "--rdzv-endpoint", "h:1", "train.py"]) == 0
        assert f"keep_alive_interval={beat}," in capsys.readouterr().out
    assert main(["run", "--dry-run", "--nnodes", "1:128", "--keep-alive", "2", "--rdzv-endpoint", "h:1", "x.py"]) == 0
    assert "keep_alive_interval=2," in capsys.readouterr().out, "an explicit value wins"


def test_run_with_a_coordinator_meets_on_its_store_and_lighthouse(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--coordinator HOST`: the rendezvous on the coordinator's store (no agent hosts it: is_host=false), one
    rendezvous id per pipeline, and its lighthouse unless TORCHFT_LIGHTHOUSE says otherwise."""
    from lightning_spot.cli import main

    monkeypatch.setenv("REPLICA_GROUP_ID", "3")
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    assert main(["run", "--dry-run", "--coordinator", "head", "--nnodes", "1:2", "train.py"]) == 0
    line = capsys.readouterr().out
    assert "TORCHFT_LIGHTHOUSE=http://head:29510" in line and "--rdzv-endpoint=head:29400" in line
    assert "--rdzv-id=lightning-spot-pipeline-3" in line and ",is_host=false,outage_timeout=120" in line
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://other:1")
    assert main(["run", "--dry-run", "--coordinator", "head:7000", "--nnodes", "1:2", "--rdzv-id", "mine", "x.py"]) == 0
    line = capsys.readouterr().out
    assert "TORCHFT_LIGHTHOUSE" not in line and "--rdzv-endpoint=head:7000" in line and "--rdzv-id=mine" in line
    assert main(["run", "--dry-run", "--coordinator", "head", "--coordinator-outage", "30", "x.py"]) == 0
    assert ",is_host=false,outage_timeout=30" in capsys.readouterr().out
    assert main(["run", "--dry-run", "--rdzv-endpoint", "head:1", "--nnodes", "1:2", "x.py"]) == 0
    assert "is_host" not in (out := capsys.readouterr().out) and "outage_timeout" not in out, "no coordinator"


@pytest.mark.timeout(60)
def test_a_rendezvous_on_a_coordinators_store_rides_through_its_restart() -> None:
    """A node's rendezvous on a store it does not host (is_host=false): the store goes away (its process restarts)
    and comes back empty on the same port. Meanwhile the agent's reads answer the last state with this node alive
    (not an error that fails the node); then the new store is given that state back: the round, complete, with
    this node in it, and its heartbeats going on."""
    import base64
    import pickle
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from lightning_spot_launch import rendezvous

    port = free_port()

    def store() -> TCPStore:
        return TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, wait_for_workers=False)

    def state_in(server: TCPStore) -> object:
        client = TCPStore("127.0.0.1", port, is_master=False, multi_tenant=True, timeout=timedelta(seconds=5))
        return pickle.loads(base64.b64decode(client.get("torch.rendezvous.coordinated")))

    server = store()
    params = RendezvousParameters(
        backend="c10d", endpoint=f"127.0.0.1:{port}", run_id="coordinated", min_nodes=1, max_nodes=2, is_host=False,
        join_timeout="10", last_call_timeout="1", keep_alive_interval="1", keep_alive_max_attempt="3",
    )  # fmt: skip
    node = rendezvous._create(params)
    try:
        assert node.next_rendezvous().world_size == 1
        del server
        gc.collect()  # (the store's server stops with it)
        down = time.monotonic()
        while time.monotonic() - down < 4.0:  # (longer than 3 missed heartbeats; a read may take a connect's 2-4 s)
            assert node.num_nodes_waiting() == 0
            time.sleep(0.5)
        server = store()
        assert node.num_nodes_waiting() == 0  # (connects again, gives the state back)
        time.sleep(1.5)  # (a heartbeat goes into the new store)
        state = state_in(server)
        assert state.complete and len(state.participants) == 1, state  # type: ignore[attr-defined]
        beats = list(state.last_heartbeats.values())  # type: ignore[attr-defined]
        assert len(beats) == 1 and (time.time() - beats[0].timestamp()) < 3, "this node must look alive"
    finally:
        node._stop_heartbeats()  # type: ignore[attr-defined]
        rendezvous._handlers.clear()
        del node
        gc.collect()


@pytest.mark.timeout(60)
def test_an_agent_that_ends_in_failure_leaves_the_rendezvous_open_for_its_relaunch() -> None:
    """torch's launcher closes the rendezvous when its agent ends (no node may join that id again): on a
    coordinator's store, which outlives the agents, a scheduler's relaunch after exit code 69 or 75 would then fail
    for good. An agent ending with a failure only leaves the round; the relaunched node meets under the same id; an
    agent whose job ended well closes it."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from lightning_spot_launch import rendezvous

    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, wait_for_workers=False)

    def node() -> object:
        params = RendezvousParameters(
            backend="c10d", endpoint=f"127.0.0.1:{port}", run_id="relaunch", min_nodes=1, max_nodes=2, is_host=False,
            join_timeout="10", last_call_timeout="1", keep_alive_interval="1", keep_alive_max_attempt="3",
        )  # fmt: skip
        return rendezvous._create(params)

    try:
        first = node()
        assert first.next_rendezvous().world_size == 1  # type: ignore[attr-defined]
        try:
            raise RuntimeError("the workers failed, restarts spent")  # (the agent exits 69 or 75)
        except RuntimeError:
            assert first.shutdown()  # type: ignore[attr-defined]  (as torch's launcher calls it, in a `finally`)
        relaunched = node()
        assert not relaunched.is_closed()  # type: ignore[attr-defined]
        assert relaunched.next_rendezvous().world_size == 1  # type: ignore[attr-defined]
        assert relaunched.shutdown()  # type: ignore[attr-defined]  (the job ended well)
        assert node().is_closed()  # type: ignore[attr-defined]
    finally:
        for handler in rendezvous._handlers:
            handler._stop_heartbeats()  # type: ignore[attr-defined]
        rendezvous._handlers.clear()
        del server
        gc.collect()


def test_an_agent_marks_the_stop_of_a_restart_and_only_that(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """torchrun's agent restarting its workers (a process failed, a node joined): its mark exists while it stops
    them (their SIGTERM is then not a notice) and is gone once they start again."""
    import os

    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from lightning_spot_launch import failures

    monkeypatch.setattr(failures.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(LocalElasticAgent, "_restart_workers", LocalElasticAgent._restart_workers)
    failures.mark_restarts()
    seen: list[tuple[str, bool]] = []

    class _Agent:
        def _stop_workers(self, group: Any) -> None:
            seen.append(("stop", failures.is_restarting(os.getpid())))

        def _initialize_workers(self, group: Any) -> None:
            seen.append(("start", failures.is_restarting(os.getpid())))

    group = type("Group", (), {"state": None})()
    LocalElasticAgent._restart_workers(_Agent(), group)  # type: ignore[arg-type]
    assert seen == [("stop", True), ("start", False)] and str(group.state).endswith("STOPPED")
