"""The one owner of this process's handlers of notice signals (SIGTERM): the parts that act on one register here.

    SIGNALS.add(signal.SIGTERM, "watcher", on_signal)        # main thread: the owner's handler goes in once
    SIGNALS.add(signal.SIGTERM, "torchft_leave", ignore)     # each registered handler is called, in order added
    SIGNALS.before(signal.SIGTERM)                           # the handler in place before the owner took over
    SIGNALS.remove(signal.SIGTERM, "watcher")                # the last one gone: that handler is put back

Three parts act on SIGTERM: ``PreemptionWatcher`` (a notice, agreed per step by ``SpotCheckpoint``),
``SigtermAgreement`` (Lightning's own stop, agreed without a per-batch broadcast) and torchft's ``LeaveOnSignal``
(a pipeline leaves at once). Each used to install a handler of its own, and the last installed silently replaced
the others; now the process holds one handler, which calls every registered part. Handlers are installed and put
back from the main thread only (Python's rule); elsewhere ``add`` records the part and installs nothing.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, Optional

Handler = Callable[[int, Optional[FrameType]], None]


class SignalOwner:
    """The handlers registered per signal, and what was in place before (see the module's text)."""

    def __init__(self) -> None:
        self._parts: dict[int, dict[str, Handler]] = {}
        self._before: dict[int, Any] = {}

    def add(self, signum: int, name: str, handler: Handler) -> None:
        """Register ``handler`` as ``name`` for ``signum`` (replacing one of that name); the owner's handler is
        installed with the first part (main thread)."""
        parts = self._parts.setdefault(signum, {})
        parts[name] = handler
        if signum not in self._before and _main_thread():
            self._before[signum] = signal.signal(signum, self._dispatch)

    def remove(self, signum: int, name: str) -> None:
        """Drop part ``name``; with none left, the handler that was in place before is put back (if the owner's is
        still the one installed)."""
        parts = self._parts.get(signum, {})
        parts.pop(name, None)
        if parts or signum not in self._before or not _main_thread():
            return
        before = self._before.pop(signum)
        if signal.getsignal(signum) == self._dispatch:
            signal.signal(signum, before)

    def before(self, signum: int) -> Any:
        """The handler of ``signum`` other than the owner's: the one it replaced, or the one installed now."""
        return self._before[signum] if signum in self._before else signal.getsignal(signum)

    def _dispatch(self, signum: int, frame: Optional[FrameType]) -> None:
        for handler in list(self._parts.get(signum, {}).values()):
            handler(signum, frame)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


#: this process's owner of notice signals
SIGNALS = SignalOwner()
