"""Take over Lightning's own SIGTERM handling: for a :class:`PreemptionWatcher`, or with a non-blocking agreement.

Lightning broadcasts rank 0's "SIGTERM received" flag over every rank before each training batch (a collective
on the critical path of every step: ~0.9 ms per step on a 2-process CPU pipeline). Once the watcher's handler
replaces Lightning's, that flag never turns True, and the watcher's notice is agreed on the process's per-step
agreement instead (``step_agreement``, ``SpotCheckpoint`` contributes it): the broadcast is skipped (the epoch loop's method is shadowed on the instance, and
restored by the returned function). A SIGTERM that Lightning's handler caught before the watcher started
becomes the watcher's notice. Without a watcher, ``SigtermAgreement`` keeps Lightning's stop, agreed on the process's
per-step agreement.

    undo = take_over_sigterm(trainer, watcher)   # after watcher.start()
    ...
    undo()
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from lightning_spot.preemption.notice import Notice
from lightning_spot.preemption.signals import SIGNALS
from lightning_spot.preemption.step_agreement import StepAgreement
from lightning_spot.preemption.watcher import PreemptionWatcher

_METHOD = "_broadcast_sigterm_tensor"
#: the agreement's name among the parts that act on SIGTERM (``signals.SIGNALS``)
_PART = "lightning_sigterm"
log = logging.getLogger(__name__)


def take_over_sigterm(trainer: Any, watcher: PreemptionWatcher) -> Callable[[], None]:
    """Skip Lightning's per-batch SIGTERM broadcast while ``watcher`` handles SIGTERM; returns the undo."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    if "SIGTERM" not in watcher.signals or loop is None or not hasattr(loop, _METHOD):
        return lambda: None
    if getattr(trainer, "received_sigterm", False):  # caught by Lightning's handler before the watcher started
        watcher.trigger(Notice("SIGTERM", time.time()))
    return _skip_broadcast(loop)


def _skip_broadcast(loop: Any) -> Callable[[], None]:
    """Shadow the epoch loop's per-batch SIGTERM broadcast on the instance; returns what puts Lightning's back."""
    loop.__dict__[_METHOD] = lambda: None
    return lambda: loop.__dict__.pop(_METHOD, None)


class SigtermAgreement:
    """Lightning's SIGTERM stop, agreed by every rank without holding any of them at a step's start.

    Lightning broadcasts rank 0's flag before every training batch and from inside its signal handler: a
    blocking collective at every step's start, which keeps all ranks in lockstep (the last stage cannot start
    its update before the first stage's last backward is done; ~5% of a short CPU pipeline step). Here a
    SIGTERM on any rank sets a flag of this object's own (Lightning's handler is replaced, its broadcast skipped);
    the flag rides on the process's :class:`~lightning_spot.preemption.step_agreement.StepAgreement` (posted at a
    batch's start, settled after the step's optimizer step, when every rank has posted it). If any rank was
    signalled, every rank then sets Lightning's ``received_sigterm`` and Lightning ends every rank at the end of
    that same batch.

        agreement = SigtermAgreement.install(trainer, step_agreement)   # None when another one is in place
        ...
        agreement.uninstall()
    """

    def __init__(self, trainer: Any, step_agreement: StepAgreement) -> None:
        self.trainer = trainer
        self.signalled = False
        self._step_agreement = step_agreement
        self._restore_broadcast = _skip_broadcast(trainer.fit_loop.epoch_loop)
        connector = trainer._signal_connector
        if connector.received_sigterm:  # caught by Lightning's handler already: agreed like any other
            self.signalled, connector.received_sigterm = True, False
        #: the handlers Lightning composed with its own (one that was installed before it): still called
        self._others = [
            h for h in getattr(SIGNALS.before(signal.SIGTERM), "signal_handlers", []) if not _is_notifier(h)
        ]
        SIGNALS.add(signal.SIGTERM, _PART, self._on_sigterm)
        step_agreement.join(_PART, lambda: [float(self.signalled)], self._agreed)

    @classmethod
    def install(cls, trainer: Any, step_agreement: StepAgreement) -> SigtermAgreement | None:
        """Take over from Lightning's per-batch broadcast unless something already did (``SpotCheckpoint``'s
        watcher), the handler is not Lightning's, or this is not the main thread of a distributed run."""
        loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        if loop is None or not hasattr(loop, _METHOD) or _METHOD in vars(loop):
            return None
        if not (dist.is_available() and dist.is_initialized() and trainer.world_size > 1):
            return None
        if threading.current_thread() is not threading.main_thread() or not _lightnings(SIGNALS.before(signal.SIGTERM)):
            return None
        return cls(trainer, step_agreement)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        log.info("lightning-spot: SIGTERM received; every rank stops at the end of the next training batch")
        launcher = self.trainer.strategy.launcher
        if launcher is not None and not self.signalled:  # as Lightning's handler: its child processes too
            launcher.kill(signum)
        self.signalled = True
        for handler in self._others:
            handler = signal.getsignal(handler) if isinstance(handler, int) else handler
            if callable(handler):
                handler(signum, frame)

    def _agreed(self, values: list[float]) -> None:
        """If any rank was signalled, every rank stops after this batch."""
        if values[0] > 0:
            self.trainer._signal_connector.received_sigterm = True

    def uninstall(self) -> None:
        self._restore_broadcast()
        self._step_agreement.leave(_PART)
        SIGNALS.remove(signal.SIGTERM, _PART)


def _lightnings(handler: Any) -> bool:
    """Whether ``handler`` is the one Lightning's signal connector installed for SIGTERM."""
    handlers = getattr(handler, "signal_handlers", None)
    return isinstance(handlers, list) and any(_is_notifier(h) for h in handlers)


def _is_notifier(handler: Any) -> bool:
    return getattr(handler, "__name__", "") == "_sigterm_notifier_fn"
