"""A preemption notice: where it came from and when the machine goes away."""

from __future__ import annotations

import time
from dataclasses import dataclass

# the exit code of every rank after a coordinated stop for preemption (EX_TEMPFAIL: "try again"); torchrun treats it
# as a worker failure and restarts the group (``--max-restarts``); defined where the launcher's agent reads it
from lightning_spot_launch import PREEMPTED_EXIT_CODE

__all__ = ["PREEMPTED_EXIT_CODE", "Notice"]


@dataclass(frozen=True)
class Notice:
    """``source`` is a signal name or a cloud ("aws", "gcp", "azure"); ``deadline`` is epoch seconds, if known."""

    source: str
    received: float
    deadline: float | None = None
    detail: str = ""

    def seconds_left(self, now: float | None = None) -> float | None:
        if self.deadline is None:
            return None
        return self.deadline - (time.time() if now is None else now)

    def describe(self) -> str:
        left = self.seconds_left()
        when = f", {left:.0f}s before the deadline" if left is not None else ""
        return f"{self.source}{f' ({self.detail})' if self.detail else ''}{when}"
