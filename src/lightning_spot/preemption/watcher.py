"""Watch for preemption notices on this rank: signals and, optionally, cloud metadata services.

    watcher = PreemptionWatcher(signals=("SIGTERM",), cloud="auto")
    watcher.start()            # from the main thread
    ...
    if watcher.notice: ...     # the first notice, or None
    watcher.stop()

A signal handler only records the notice; the training loop acts on it at the next step boundary.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import Union

from lightning_spot.preemption.cloud import DEFAULT_ENDPOINTS, POLLERS, CloudPoller, detect_cloud
from lightning_spot.preemption.notice import Notice
from lightning_spot.preemption.signals import SIGNALS
from lightning_spot_launch import AGENT_PID_ENV
from lightning_spot_launch.failures import is_restarting

#: the watcher's name among the parts that act on a signal (``signals.SIGNALS``)
_PART = "preemption_watcher"

log = logging.getLogger(__name__)

CloudArg = Union[str, Sequence[str], None]


class PreemptionWatcher:
    """Records the first preemption notice this process receives.

    Args:
        signals: signal names that mean "you are about to be preempted" (SIGTERM is what torchrun's
            agent, Kubernetes and most schedulers send).
        cloud: ``"auto"`` (poll the metadata service of the cloud this machine is detected on),
            ``None`` (no polling), or one or more of ``"aws"``, ``"gcp"``, ``"azure"``.
        poll_interval: seconds between metadata polls.
        endpoints: metadata service base URLs per cloud (defaults: the real link-local services).
    """

    def __init__(
        self,
        signals: Sequence[str] = ("SIGTERM",),
        cloud: CloudArg = "auto",
        poll_interval: float = 5.0,
        endpoints: dict[str, str] | None = None,
    ) -> None:
        self.signals = [s.upper() if s.upper().startswith("SIG") else f"SIG{s.upper()}" for s in signals]
        for name in self.signals:
            if not hasattr(signal, name):
                raise ValueError(f"unknown signal {name!r}")
        if cloud == "auto":
            detected = detect_cloud()
            self.clouds = [detected] if detected else []
        elif cloud is None:
            self.clouds = []
        else:
            self.clouds = [cloud] if isinstance(cloud, str) else list(cloud)
        unknown = [c for c in self.clouds if c not in POLLERS]
        if unknown:
            raise ValueError(f"unknown cloud(s) {unknown}; choose from {sorted(POLLERS)}")
        self.poll_interval = poll_interval
        self.endpoints = {**DEFAULT_ENDPOINTS, **(endpoints or {})}
        self._notice: Notice | None = None
        self._lock = threading.Lock()
        self._pollers: list[CloudPoller] = []

    @property
    def notice(self) -> Notice | None:
        return self._notice

    def trigger(self, notice: Notice, said: bool = False) -> None:
        """Record ``notice`` unless one was recorded already (the first one counts); ``said``: already logged."""
        with self._lock:
            if self._notice is None:
                self._notice = notice
                if not said:
                    log.warning("lightning-spot: preemption notice: %s", notice.describe())

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        agent = os.environ.get(AGENT_PID_ENV)
        restart = signum == signal.SIGTERM and agent is not None and is_restarting(int(agent))
        if restart and self._notice is None:  # (not a preemption: the agent stops its workers to start them again)
            log.warning(
                "lightning-spot: SIGTERM from this node's agent, which restarts the pipeline (a process failed or a node joined)"
            )
        why = "from the agent, for a restart" if restart else ""
        self.trigger(Notice(signal.Signals(signum).name, time.time(), detail=why), said=restart)

    def start(self) -> None:
        """Install the signal handlers (main thread only) and start the cloud pollers."""
        if threading.current_thread() is threading.main_thread():
            for name in self.signals:
                SIGNALS.add(getattr(signal, name), _PART, self._on_signal)
        elif self.signals:
            log.warning("lightning-spot: not in the main thread; preemption signals are not watched")
        for cloud in self.clouds:
            poller = CloudPoller(cloud, self.endpoints[cloud], self.poll_interval, self.trigger)
            poller.start()
            self._pollers.append(poller)

    def stop(self) -> None:
        """Leave the signals (their previous handlers come back with the last part) and stop polling."""
        for name in self.signals:
            SIGNALS.remove(getattr(signal, name), _PART)
        for poller in self._pollers:
            poller.stop()
        self._pollers.clear()
