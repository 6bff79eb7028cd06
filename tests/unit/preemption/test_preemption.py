"""Preemption pieces in one process: the torchrun command, a cloud notice, the watcher taking over Lightning's SIGTERM broadcast."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest


def test_run_wrapper_builds_the_elastic_torchrun_command(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_spot.cli import main

    assert (
        main(
            [
                "run",
                "--dry-run",
                "--nnodes",
                "1:4",
                "--nproc-per-node",
                "8",
                "--rdzv-endpoint",
                "head:29400",
                "train.py",
                "--lr",
                "0.1",
            ]
        )
        == 0
    )
    line = capsys.readouterr().out
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in line
    for part in (
        "-m lightning_spot_launch",
        "--nproc-per-node=8",
        "--max-restarts=100",
        "--nnodes=1:4",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=head:29400",
        "--rdzv-conf=keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=2",
        "train.py --lr 0.1",
    ):
        assert part in line
    assert main(["run", "--dry-run", "train.py"]) == 0 and "--standalone" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="need --rdzv-endpoint"):
        main(["run", "--dry-run", "--nnodes", "2", "train.py"])


def test_a_cloud_notice_makes_the_node_leave_a_torchrun_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rank whose own cloud notice says its machine goes asks its torchrun agent (its parent, or the
    agent named by lightning-spot run) to leave;
    a signal notice (it came through the agent), a notice seen by another rank, or no torchrun: nothing."""
    from lightning_spot.preemption import stop
    from lightning_spot.preemption.notice import Notice

    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(stop.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    monkeypatch.setattr(stop.os, "getppid", lambda: 4242)
    monkeypatch.delenv("LIGHTNING_SPOT_AGENT_PID", raising=False)
    aws = Notice("aws", 0.0, 120.0, "spot instance-action terminate")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert not stop.leave_if_reclaimed(aws), "not under torchrun"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert not stop.leave_if_reclaimed(Notice("SIGTERM", 0.0)) and not stop.leave_if_reclaimed(None)
    assert sent == []
    assert stop.leave_if_reclaimed(aws)
    assert sent == [(4242, signal.SIGTERM)]
    monkeypatch.setenv("LIGHTNING_SPOT_AGENT_PID", "777")  # lightning-spot run's forked workers: not the parent
    assert stop.leave_if_reclaimed(aws) and sent[-1] == (777, signal.SIGTERM)


def test_the_watcher_takes_over_lightnings_per_step_sigterm_broadcast() -> None:
    """While the watcher handles SIGTERM, Lightning's broadcast before every batch is skipped (its flag cannot turn
    True); a SIGTERM Lightning caught before becomes the watcher's notice; undo restores Lightning's method."""
    import lightning as L

    from lightning_spot.preemption.lightning_sigterm import take_over_sigterm
    from lightning_spot.preemption.watcher import PreemptionWatcher

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    loop = trainer.fit_loop.epoch_loop
    watcher = PreemptionWatcher(cloud=None)
    undo = take_over_sigterm(trainer, watcher)
    assert loop._broadcast_sigterm_tensor() is None and "_broadcast_sigterm_tensor" in vars(loop)
    assert watcher.notice is None
    undo()
    assert "_broadcast_sigterm_tensor" not in vars(loop)

    trainer._signal_connector.received_sigterm = True
    take_over_sigterm(trainer, watcher)()
    assert watcher.notice is not None and watcher.notice.source == "SIGTERM"
    assert take_over_sigterm(trainer, PreemptionWatcher(signals=("SIGUSR1",), cloud=None)) is not None
    assert "_broadcast_sigterm_tensor" not in vars(loop)  # not watching SIGTERM: Lightning keeps its own


def test_a_sigterm_from_an_agent_restarting_its_workers_is_logged_as_a_restart(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """torchrun's agent stops every worker with SIGTERM to restart them (a process failed, a node joined); while it
    does, its mark exists (``failures.mark_restarts``), and the workers say so instead of "preemption notice"."""
    from lightning_spot.preemption import PreemptionWatcher
    from lightning_spot_launch import AGENT_PID_ENV, failures

    monkeypatch.setattr(failures.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setenv(AGENT_PID_ENV, "4242")
    watcher = PreemptionWatcher(cloud=None)
    open(failures.restarting_mark(4242), "w").close()
    with caplog.at_level("WARNING"):
        watcher._on_signal(signal.SIGTERM, None)
    assert "SIGTERM from this node's agent, which restarts the pipeline" in caplog.text
    assert "preemption notice" not in caplog.text and watcher.notice is not None  # (it stops as before)
    os.remove(failures.restarting_mark(4242))
    caplog.clear()
    again = PreemptionWatcher(cloud=None)
    with caplog.at_level("WARNING"):
        again._on_signal(signal.SIGTERM, None)
    assert "preemption notice: SIGTERM" in caplog.text, "no mark: a notice (forwarded by the agent)"
