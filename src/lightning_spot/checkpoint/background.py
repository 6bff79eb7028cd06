"""Background threads for checkpoint work that yield the CPU to training.

    thread = start_background(target, arg1, arg2)   # a daemon thread at the lowest CPU priority

Serialising, checksumming and writing a checkpoint take CPU time that training would otherwise use
(on a busy machine every millisecond of it shows in the loop's wall time). The thread lowers its own
scheduling priority (Linux: per-thread nice 19) so that it runs mostly when training waits (pipeline
bubbles, communication); where the OS does not allow it, it runs at normal priority.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

NICE = 19


def lower_priority() -> None:
    """Give the calling thread the lowest CPU priority, where the OS allows (a no-op elsewhere)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
    except (AttributeError, OSError):
        pass


def start_background(target: Callable[..., Any], *args: Any) -> threading.Thread:
    """Run ``target(*args)`` in a daemon thread at the lowest CPU priority; returns the started thread."""

    def run() -> None:
        lower_priority()
        target(*args)

    thread = threading.Thread(target=run, daemon=True, name=f"lightning-spot-{getattr(target, '__name__', 'io')}")
    thread.start()
    return thread
