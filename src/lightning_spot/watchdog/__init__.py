"""Failures: one rank's error (or a frozen peer) stops every rank of the job at once, the error shown once."""

from lightning_spot.watchdog.board import Failure, FailureBoard
from lightning_spot.watchdog.watch import (
    DEFAULT_STEP_TIMEOUT,
    DEFAULT_TIMEOUT,
    FAILED_EXIT_CODE,
    PEER_LOST_EXIT_CODE,
    CoordinatorLostError,
    JobWatch,
)

__all__ = [
    "DEFAULT_STEP_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "FAILED_EXIT_CODE",
    "PEER_LOST_EXIT_CODE",
    "CoordinatorLostError",
    "Failure",
    "FailureBoard",
    "JobWatch",
]
