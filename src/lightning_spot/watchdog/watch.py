"""Every rank stops within seconds when one rank fails or a peer freezes, and the error is shown once.

    watch = JobWatch(rank, step_timeout=60.0, first_step_timeout=600.0)
    watch.start()                        # after the process group exists: polls the failure board
    with watch.step("train"): ...        # a pipeline step: no progress for too long = a peer is frozen or gone
    watch.on_exception(err)              # from the strategy's on_exception: publish, or recognise a consequence
    watch.stop()

Three ways a rank leaves:

* **It raised.** ``on_exception`` publishes the error on the :class:`FailureBoard` before Lightning tears down
  (the first failure wins) and the rank exits with the traceback, as Python does (exit code 1; 69 when the
  error was a collective that lost its peer).
* **Another rank failed.** The watch thread sees the board, prints one line naming that rank and its error, gives
  the main thread :attr:`JobWatch.GRACE` seconds to end by itself (an error of its own: a closed connection),
  then exits the process (:data:`FAILED_EXIT_CODE`, or :data:`PEER_LOST_EXIT_CODE` when the first failure was a
  lost or frozen peer), whatever it was waiting for (a collective on a peer
  that is gone, an NCCL kernel). An error this rank raised that is a consequence (a collective that lost its
  peer) prints that one line instead of its traceback.
* **Its step made no progress.** A pipeline step running longer than its limit (``step_timeout``, or five times
  the median of the recent steps if that is longer; the first step of each kind: ``first_step_timeout``)
  means a peer is frozen (a VM that vanished without closing its sockets) or gone; gloo's point-to-point
  receives have no timeout at all. The rank publishes that and exits.

A preemption stop (exit code 75) is not a failure: every rank exits alike. ``lightning-spot run`` restarts the
job after preemptions and lost peers, and after errors only ``--max-failures`` times.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import TracebackType

import torch.distributed as dist

from lightning_spot.watchdog.board import Failure, FailureBoard
from lightning_spot_launch import FAILED_EXIT_CODE, PEER_LOST_EXIT_CODE, PREEMPTED_EXIT_CODE

__all__ = [
    "DEFAULT_STEP_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "FAILED_EXIT_CODE",
    "PEER_LOST_EXIT_CODE",
    "CoordinatorLostError",
    "JobWatch",
]

log = logging.getLogger(__name__)

#: the collective timeout's default: setup, saves and epoch boundaries wait at most this long for a peer (above
#: per-rank pretrained reads and blocking saves of large stages; torch's default is 30 minutes for gloo)
DEFAULT_TIMEOUT = timedelta(minutes=10)
#: a pipeline step's limit in seconds (or five times the median of the recent steps, if longer)
DEFAULT_STEP_TIMEOUT = 60.0
#: words in the message of an error that a collective raises when its peer is gone or silent (gloo's, NCCL's watchdog);
#: not a bare "timeout": an error of the user's code that mentions one is an error, not a lost peer, and is not
#: restarted as one
_LOST_PEER = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out waiting",  # gloo: "Timed out waiting 30000ms for recv operation to complete"
    "timeout caused pair closure",  # gloo, the next operation on that pair
    "before timing out",  # NCCL's watchdog: "... ran for 600019 milliseconds before timing out"
)


class CoordinatorLostError(ConnectionError):
    """The job's coordinator (its rendezvous store, its torchft lighthouse) stayed unreachable longer than its
    timeouts. Not an error of the job's code: every rank exits as for a lost peer (:data:`PEER_LOST_EXIT_CODE`), so
    that a scheduler relaunches the job, which resumes from its durable checkpoints once the coordinator is back."""


class JobWatch:
    """This rank's side of failure handling (see the module docstring)."""

    #: seconds between two reads of the failure board (more with many ranks: the store serves every rank's reads,
    #: at most :attr:`STORE_READS` per second in all)
    POLL = 0.2
    STORE_READS = 5000
    #: seconds a rank gets to end by itself once another rank's failure is known
    GRACE = 2.0
    #: the limit of a step: this many times the median of the recent steps of its kind (when above ``step_timeout``)
    STEP_FACTOR = 5.0

    #: seconds the rank that hosts the store stays after deciding to leave, so that the others can read the board
    LINGER = 1.0

    def __init__(self, rank: int, step_timeout: float | None, first_step_timeout: float, world: int = 1) -> None:
        self.rank = rank
        self.poll = max(self.POLL, world / self.STORE_READS)
        #: rank 0 hosts the job's store unless torchrun's agent does: when it leaves, the board goes with it
        self.linger = self.LINGER if rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" else 0.0
        self.step_timeout = step_timeout
        self.first_step_timeout = first_step_timeout
        self.board: FailureBoard | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: the main thread is handling an error (Lightning's on_exception ran): it ends the fit by itself
        self._handling = False
        #: the one line naming the first failure was printed
        self._said = False
        #: another rank's failure, once this rank has seen it
        self._known: Failure | None = None
        #: where the step that raised was (for the published failure)
        self._failed_in = ""
        #: the step being watched: (description, start, limit)
        self._armed: tuple[str, float, float] | None = None
        self._recent: dict[str, deque[float]] = {}

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start watching (a daemon thread); without a process group there is nothing to watch."""
        self.board = FailureBoard.for_job()
        if self.board is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="lightning-spot-job-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.poll)
            self._thread = None

    # ---------------------------------------------------------------------- steps
    @contextlib.contextmanager
    def step(self, kind: str, where: str = "") -> Iterator[None]:
        """Watch one pipeline step of ``kind`` ("training_step", ...; ``where``: its description) for progress."""
        if self.step_timeout is None or self._thread is None:
            yield
            return
        recent = self._recent.setdefault(kind, deque(maxlen=16))
        limit = (
            max(self.step_timeout, self.STEP_FACTOR * statistics.median(recent)) if recent else self.first_step_timeout
        )
        start = time.monotonic()
        where = where or kind
        self._armed = (where, start, limit)
        try:
            yield
        except BaseException:
            self._failed_in = where
            raise
        finally:
            self._armed = None
        recent.append(time.monotonic() - start)

    # ------------------------------------------------------------------ failures
    def on_exception(self, error: BaseException) -> None:
        """The main thread is handling ``error`` (Lightning's ``on_exception``): publish it, or, when another rank
        failed first and this error is its consequence, show one line instead of the traceback."""
        if isinstance(error, SystemExit) and error.code == PREEMPTED_EXIT_CODE:
            return  # a coordinated preemption stop: every rank exits alike
        if type(error).__name__ == "SIGTERMException":
            return  # Lightning's own SIGTERM stop, agreed by every rank
        self._handling = True
        if self.board is None:
            return
        lost, line = _is_lost_peer(error), _one_line(error)
        first = self._known or self.board.publish(Failure(self.rank, line, self._failed_in, peer=lost))
        if first is not None and first.rank != self.rank and (lost or line == first.error):
            _end_uncaught(error, lambda: self.say(self._line(first)), self.linger, _exit_code(first))  # a consequence
        elif first is None and lost:  # the store's host is gone too: some rank left first
            said = (
                f"lightning-spot: rank {self.rank} stops: a peer left the job ({line[:200]}); the rank that "
                f"failed first shows its error (none does: it was killed, e.g. out of memory, or its node was lost)"
            )
            _end_uncaught(error, lambda: self.say(said), self.linger, PEER_LOST_EXIT_CODE)
        else:
            if first is not None and lost and not _coordinator_lost(error):
                log.error(
                    "lightning-spot: rank %d: a collective lost its peer and no other rank reported a failure: a peer "
                    "was killed, froze or lost its network (the collective timeout is SpotPipelineStrategy(timeout=...))",
                    self.rank,
                )
            _end_uncaught(error, None, self.linger, PEER_LOST_EXIT_CODE if lost else FAILED_EXIT_CODE)  # its traceback

    def _line(self, first: Failure) -> str:
        return f"lightning-spot: rank {self.rank} stops because {first.describe()} (its traceback is in rank {first.rank}'s output)"

    # --------------------------------------------------------------- the thread
    def _run(self) -> None:
        assert self.board is not None
        store_up = True
        while not self._stop.wait(self.poll):
            armed = self._armed
            if armed is not None and time.monotonic() - armed[1] > armed[2]:
                self._stalled(*armed)
                return
            if not store_up:
                continue
            try:
                first = self.board.read()
            except Exception:  # the store's host left (the job is ending); stalls are still watched
                store_up = False
                continue
            if first is not None and first.rank != self.rank:
                self._known = first  # the store may be gone by the time this rank's own error comes
                if not self._handling:
                    self._leave(first)
                return

    def _leave(self, first: Failure) -> None:
        """Another rank failed: say so, and leave unless the main thread gets to handle an error by itself."""
        self.say(self._line(first))
        deadline = time.monotonic() + self.GRACE
        while time.monotonic() < deadline:
            if self._stop.wait(self.poll) or self._handling:
                return  # the fit is ending by itself (an error of its own, or a closed connection)
        _exit(_exit_code(first), self.linger)

    def say(self, line: str) -> None:
        """Print the line naming the first failure (once)."""
        if not self._said:
            self._said = True
            print(line, file=sys.stderr, flush=True)

    def _stalled(self, where: str, start: float, limit: float) -> None:
        waited = time.monotonic() - start
        failure = Failure(
            self.rank,
            f"no progress for {waited:.1f}s (limit {limit:.0f}s): a peer is frozen or gone "
            f"(SpotPipelineStrategy(step_timeout=...) sets the limit)",
            where,
            peer=True,
        )
        board = self.board
        assert board is not None
        publisher = threading.Thread(target=board.publish, args=(failure,), daemon=True)
        publisher.start()
        publisher.join(timeout=3.0)  # a frozen store host must not hold this rank
        self.say(f"lightning-spot: {failure.describe()}; stopping the job")
        _exit(PEER_LOST_EXIT_CODE, self.linger)


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and the errors it wraps (``raise ... from``), outermost first."""
    chain = [error]
    while chain[-1].__cause__ is not None:
        chain.append(chain[-1].__cause__)
    return chain


def _one_line(error: BaseException) -> str:
    """The error's type and first line; for an error that wraps another (``raise ... from``), the innermost one."""
    error = _chain(error)[-1]
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:500]


def _is_lost_peer(error: BaseException) -> bool:
    """Whether ``error``, or one it wraps (torch's "Failed to run stage backward" wraps a DDP all-reduce's), is a
    collective that lost its peer, or the job's coordinator that is gone."""
    return _coordinator_lost(error) or any(
        isinstance(cause, getattr(dist, "DistError", ()))
        or (isinstance(cause, RuntimeError) and any(w in str(cause).lower() for w in _LOST_PEER))
        for cause in _chain(error)
    )


def _coordinator_lost(error: BaseException) -> bool:
    """Whether ``error``, or one it wraps, says the job's coordinator is gone (:class:`CoordinatorLostError`)."""
    return any(isinstance(cause, CoordinatorLostError) for cause in _chain(error))


def _exit_code(first: Failure) -> int:
    """How a rank that stops for ``first`` exits: a lost peer is restarted as such, an error counts as one."""
    return PEER_LOST_EXIT_CODE if first.peer else FAILED_EXIT_CODE


def _end_uncaught(error: BaseException, say: Callable[[], None] | None, linger: float, code: int) -> None:
    """If ``error`` ends the process uncaught: ``say()`` instead of its traceback (``None``: the traceback), then
    exit with ``code`` at once: the interpreter's shutdown can abort (SIGABRT) on a process group whose peers are
    gone."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if value is not error:
            previous(kind, value, tb)
            return
        if say is None:
            previous(kind, value, tb)
        else:
            say()
        _exit(code, linger)

    sys.excepthook = hook


def _exit(code: int, linger: float = 0.0) -> None:
    """Leave now, with ``code``, ``linger`` seconds from now (the store's host: the others read the board)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    time.sleep(linger)
    os._exit(code)
