"""Take over Lightning's own SIGTERM handling while a :class:`PreemptionWatcher` watches SIGTERM.

Lightning broadcasts rank 0's "SIGTERM received" flag over every rank before each training batch (a collective
on the critical path of every step: ~0.9 ms per step on a 2-process CPU pipeline). Once the watcher's handler
replaces Lightning's, that flag never turns True, and the watcher's notice is agreed by ``SpotCheckpoint``'s own
per-step all-reduce instead: the broadcast is skipped (the epoch loop's method is shadowed on the instance, and
restored by the returned function). A SIGTERM that Lightning's handler caught before the watcher started
becomes the watcher's notice.

    undo = take_over_sigterm(trainer, watcher)   # after watcher.start()
    ...
    undo()
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from lightning_spot.preemption.notice import Notice
from lightning_spot.preemption.watcher import PreemptionWatcher

_METHOD = "_broadcast_sigterm_tensor"


def take_over_sigterm(trainer: Any, watcher: PreemptionWatcher) -> Callable[[], None]:
    """Skip Lightning's per-batch SIGTERM broadcast while ``watcher`` handles SIGTERM; returns the undo."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    if "SIGTERM" not in watcher.signals or loop is None or not hasattr(loop, _METHOD):
        return lambda: None
    if getattr(trainer, "received_sigterm", False):  # caught by Lightning's handler before the watcher started
        watcher.trigger(Notice("SIGTERM", time.time()))
    loop.__dict__[_METHOD] = lambda: None

    def undo() -> None:
        loop.__dict__.pop(_METHOD, None)

    return undo
