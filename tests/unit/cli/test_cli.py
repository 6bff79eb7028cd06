"""The ``lightning-spot`` command in one process: its help, an unknown command, the cores given to replica groups."""

from __future__ import annotations

import pytest

from lightning_spot.cli import main


def test_console_script_help_and_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "lightning-spot {fit,validate,test,predict}" in capsys.readouterr().out
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_replica_groups_share_the_cores_among_all_pipelines(monkeypatch: pytest.MonkeyPatch) -> None:
    """`lightning-spot run --replica-groups`: torchrun sizes threads only among its own workers (not at all for
    one), so each pipeline's processes get the machine's cores divided by every process of every pipeline; a
    user's OMP_NUM_THREADS wins; 'gpu'/'cpu' process counts are left to torchrun."""
    import os

    from lightning_spot_launch.run import _threads_per_process

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert _threads_per_process(2, "1") == 8
    assert _threads_per_process(3, "2") == 2
    assert _threads_per_process(32, "1") == 1
    assert _threads_per_process(2, "gpu") is None
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert _threads_per_process(2, "1") is None
