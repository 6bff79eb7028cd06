"""One owner of the process's SIGTERM handler: every part registered is called, the previous handler comes back."""

from __future__ import annotations

import os
import signal
import time
from types import FrameType
from typing import Optional

from lightning_spot.preemption import PreemptionWatcher
from lightning_spot.preemption.signals import SIGNALS, SignalOwner


def test_every_part_is_called_and_the_handler_before_comes_back() -> None:
    seen: list[str] = []

    def before(signum: int, frame: Optional[FrameType]) -> None:
        seen.append("before")

    original = signal.signal(signal.SIGUSR2, before)
    try:
        owner = SignalOwner()
        owner.add(signal.SIGUSR2, "a", lambda s, f: seen.append("a"))
        owner.add(signal.SIGUSR2, "b", lambda s, f: seen.append("b"))
        assert owner.before(signal.SIGUSR2) is before
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.05)
        assert seen == ["a", "b"], "both parts acted; the handler they replaced did not"
        owner.remove(signal.SIGUSR2, "a")
        assert signal.getsignal(signal.SIGUSR2) is not before, "a part is left: the owner's handler stays"
        owner.remove(signal.SIGUSR2, "b")
        assert signal.getsignal(signal.SIGUSR2) is before
    finally:
        signal.signal(signal.SIGUSR2, original)


def test_the_watcher_and_a_second_part_both_see_sigterm() -> None:
    """The preemption watcher no longer replaces another part's handler (nor is replaced by it)."""
    original = signal.getsignal(signal.SIGTERM)
    seen: list[int] = []
    watcher = PreemptionWatcher(cloud=None)
    SIGNALS.add(signal.SIGTERM, "test_part", lambda s, f: seen.append(s))
    watcher.start()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert watcher.notice is not None and watcher.notice.source == "SIGTERM"
        assert seen == [signal.SIGTERM]
    finally:
        watcher.stop()
        SIGNALS.remove(signal.SIGTERM, "test_part")
    assert signal.getsignal(signal.SIGTERM) == original
