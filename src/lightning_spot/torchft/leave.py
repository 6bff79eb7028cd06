"""A pipeline that is told to go (SIGTERM: its torchrun stopping it because one of its processes died, or a
preemption notice) leaves at once, so that it never holds up the other pipelines' quorum.

    leave = LeaveOnSignal(on_leave=group.shutdown)   # main thread, once training starts
    ...
    leave.stop()

A Python signal handler runs only when the main thread is back in the interpreter; this one may be blocked in a
collective or in torchft's quorum for as long as its peer is gone. So the C-level handler also writes the signal
number to a pipe (``signal.set_wakeup_fd``) that a thread reads: the process stops heartbeating and exits within
milliseconds whatever the main thread is doing. The other pipelines hold the state: nothing is saved here.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from types import FrameType

from lightning_spot.preemption import PREEMPTED_EXIT_CODE
from lightning_spot.preemption.signals import SIGNALS

#: the leave's name among the parts that act on a signal (``signals.SIGNALS``)
_PART = "torchft_leave"


class LeaveOnSignal:
    """Exit this process (after ``on_leave``) as soon as one of ``signals`` arrives."""

    def __init__(self, on_leave: Callable[[], None], signals: Sequence[int] = (signal.SIGTERM,), who: str = "") -> None:
        self.on_leave = on_leave
        self.signals = tuple(signals)
        self.who = who
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._old_fd = -1
        self._thread = threading.Thread(target=self._wait, name="lightning-spot-leave", daemon=True)

    def start(self) -> None:
        """Install the handlers and the wake-up pipe (from the main thread)."""
        for signum in self.signals:
            SIGNALS.add(signum, _PART, self._ignore)
        self._old_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._thread.start()

    @staticmethod
    def _ignore(signum: int, frame: FrameType | None) -> None:
        """The Python-level handler: nothing to do, the thread acts (it must exist for the C handler to run)."""

    def _wait(self) -> None:
        while True:
            try:
                data = os.read(self._read, 64)
            except OSError:
                return
            if not data or 0 in data:  # closed, or stop()
                return
            hit = next((s for s in data if s in self.signals), None)
            if hit is not None:
                name = signal.Signals(hit).name
                print(
                    f"lightning-spot: {self.who} leaves at once ({name}); the other pipelines go on",
                    file=sys.stderr,
                    flush=True,
                )
                try:
                    self.on_leave()
                finally:
                    os._exit(PREEMPTED_EXIT_CODE)

    def stop(self) -> None:
        """Restore the previous handlers and wake-up fd (main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return
        signal.set_wakeup_fd(self._old_fd)
        for signum in self.signals:
            SIGNALS.remove(signum, _PART)
        if self._thread.is_alive():
            os.write(self._write, b"\0")
            self._thread.join(timeout=1.0)
        os.close(self._write)
        os.close(self._read)
