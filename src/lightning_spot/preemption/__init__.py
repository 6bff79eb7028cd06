"""Preemption notices (signals, cloud spot notices) that lead to a coordinated checkpoint and a restartable exit."""

from lightning_spot.preemption.notice import PREEMPTED_EXIT_CODE, Notice
from lightning_spot.preemption.stop import PreemptionStop, stop_for_preemption
from lightning_spot.preemption.watcher import PreemptionWatcher

__all__ = ["PREEMPTED_EXIT_CODE", "Notice", "PreemptionStop", "PreemptionWatcher", "stop_for_preemption"]
