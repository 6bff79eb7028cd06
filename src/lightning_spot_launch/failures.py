"""Restarts for what spot capacity does to a job, a limit for errors of its code.

    limit_error_restarts(max_failures=2)   # before the agent starts: patches torchrun's agent

torchrun restarts a worker group after any failure, up to ``--max-restarts``: a bug in ``training_step`` would run
again a hundred times. Here a failure counts as an error when a worker's exit code is neither a preemption
(:data:`~lightning_spot_launch.PREEMPTED_EXIT_CODE`), a lost peer (:data:`~lightning_spot_launch.PEER_LOST_EXIT_CODE`,
what lightning_spot's ranks exit with when a peer was killed, froze or lost its node) nor a signal (the worker was
killed: the OOM killer, a node going away); after ``max_failures`` restarts for errors, the next error ends the job.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterable
from typing import Any

from lightning_spot_launch import FAILED_EXIT_CODE, MOVED_EXIT_CODE, PEER_LOST_EXIT_CODE, PREEMPTED_EXIT_CODE

#: a file that exists while an agent stops its workers for a restart (a worker failed, a node joined): their SIGTERM
#: then is not a preemption notice
RESTARTING_MARK = "lightning-spot-restarting-{pid}"

#: exit codes that a restart is for
RESTARTED = frozenset({PREEMPTED_EXIT_CODE, PEER_LOST_EXIT_CODE})


def is_error(exit_codes: Iterable[int | None]) -> bool:
    """Whether a failed worker group failed by an error of the job's code (see the module docstring; workers
    leaving for another pipeline, ``moves``, are not)."""
    return any(code is not None and code > 0 and code not in {*RESTARTED, MOVED_EXIT_CODE} for code in exit_codes)


def agent_exit_code(exit_codes: Iterable[int | None]) -> int:
    """The agent's own exit code when its workers failed and it restarts them no more, for the scheduler that
    runs it: an error of the job's code 1, else a preemption 75 when a worker said so, else a lost peer 69 (killed
    workers too: their node going away). Schedulers recover on 75 and 69 and fail the job on 1."""
    codes = list(exit_codes)
    if is_error(codes):
        return FAILED_EXIT_CODE
    return PREEMPTED_EXIT_CODE if PREEMPTED_EXIT_CODE in codes else PEER_LOST_EXIT_CODE


def limit_error_restarts(max_failures: int) -> None:
    """Make torchrun's agent (this process's) end the job at the error after ``max_failures`` restarts for errors;
    preemptions, lost peers and kills are restarted as before (up to ``--max-restarts``)."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    monitor = LocalElasticAgent._monitor_workers
    errors = 0

    def monitored(self: Any, worker_group: Any) -> Any:
        nonlocal errors
        result = monitor(self, worker_group)
        failed = result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY)
        codes = [f.exitcode for f in result.failures.values()]
        if failed and is_error(codes):
            errors += 1
            if errors > max_failures:
                self._remaining_restarts = 0
                what = "not restarting" if max_failures == 0 else f"{errors} times: not restarting again"
                print(
                    f"lightning-spot run: the workers failed with an error (exit codes {codes}), {what} "
                    f"(--max-failures {max_failures}). Preemptions (exit code {PREEMPTED_EXIT_CODE}), lost peers "
                    f"({PEER_LOST_EXIT_CODE}) and killed workers are restarted up to --max-restarts.",
                    file=sys.stderr,
                    flush=True,
                )
        return result

    LocalElasticAgent._monitor_workers = monitored  # type: ignore[method-assign]


def restarting_mark(agent_pid: int) -> str:
    """The path of :data:`RESTARTING_MARK` for the agent ``agent_pid``."""
    return os.path.join(tempfile.gettempdir(), RESTARTING_MARK.format(pid=agent_pid))


def is_restarting(agent_pid: int) -> bool:
    """(A worker, on SIGTERM) whether its agent is stopping it for a restart rather than for a notice."""
    return os.path.exists(restarting_mark(agent_pid))


def mark_restarts() -> None:
    """Make torchrun's agent (this process's) say, while it stops its workers for a restart, that it does
    (:func:`is_restarting`): they log a restart, not a preemption notice."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    def restart(self: Any, worker_group: Any) -> None:  # (torch's _restart_workers, the stop marked)
        mark = restarting_mark(os.getpid())
        open(mark, "w").close()
        try:
            self._stop_workers(worker_group)
        finally:
            os.remove(mark)
        worker_group.state = WorkerState.STOPPED
        self._initialize_workers(worker_group)

    LocalElasticAgent._restart_workers = restart  # type: ignore[method-assign]
