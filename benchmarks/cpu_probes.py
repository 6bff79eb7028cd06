"""Where a training step's CPU time goes on each rank: thread CPU time spent inside named functions.

    probes = CpuProbes(warmup=4)        # in a worker, before training: wraps the functions of PARTS
    probes.install(strategy=True)
    ...                                 # train; the first `warmup` schedule steps are not counted
    probes.mark_end()                   # after the last measured step
    probes.per_step()                   # {part: CPU ms per step} of the main thread; other threads, also by name

With more processes than cores (four ranks on two), a step's time follows the CPU time of all ranks
together, so a difference of CPU time in one part shows where a slower implementation loses. The times
are ``time.thread_time`` of the calling thread, which a preempted thread does not accumulate (unlike wall
time or sampling profilers). Parts nest (a stage's forward is inside the schedule); the wrappers cost
about a microsecond per call, charged to the enclosing part. ``pipeline_throughput.py --cpu-breakdown``
prints the table.
"""

from __future__ import annotations

import functools
import importlib
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: (label, module, attribute path, whether only the strategy has it); in the order the table shows them
PARTS: list[tuple[str, str, str, bool]] = [
    (
        "schedule.step (+ input split)",
        "torch.distributed.pipelining.schedules",
        "PipelineScheduleSingle.step",
        False,
    ),
    ("  input split", "torch.distributed.pipelining.schedules", "_PipelineSchedule._split_inputs", False),
    ("schedule", "torch.distributed.pipelining.schedules", "Schedule1F1B._step_microbatches", False),
    ("  stage forwards", "torch.distributed.pipelining.stage", "_PipelineStageBase.forward_one_chunk", False),
    ("    step replays (stages)", "lightning_spot.runtime.step_runner", "StepRunner.stage_forward", True),
    ("    step replays (last: loss)", "lightning_spot.runtime.step_runner", "StepRunner.loss_fn", True),
    ("      taking micro-batches", "lightning_spot.runtime.step_runner", "StepRunner._micro_batch", True),
    ("  stage backwards", "torch.distributed.pipelining.stage", "_PipelineStageBase.backward_one_chunk", False),
    ("  posting sends/receives", "torch.distributed.pipelining.schedules", "_batch_p2p", False),
    ("  waiting for them", "torch.distributed.pipelining.schedules", "_wait_batch_p2p", False),
    ("engine train step", "lightning_spot.runtime.engine", "PipelineEngine.train_step", True),
    ("  logged values", "lightning_spot.runtime.engine", "PipelineEngine._share_logs", True),
    ("optimizer step", "torch.optim", "Adam.step", False),
    (
        "  Lightning closure (+ step)",
        "lightning.pytorch.loops.optimization.automatic",
        "Closure.closure",
        True,
    ),
    ("Lightning callback hooks", "lightning.pytorch.trainer.call", "_call_callback_hooks", True),
    ("zero_grad", "torch.optim", "Optimizer.zero_grad", False),
    ("data loading", "torch.utils.data.dataloader", "_BaseDataLoaderIter.__next__", False),
]
MAIN, OTHERS = "main thread, all", "other threads"
WALL_SCHEDULE, WALL_BETWEEN = "wall ms: schedule (median)", "wall ms: between schedules"
#: the process's minor page faults per step, in thousands (fresh pages from the allocator); CPU of a thread, by name
FAULTS, THREAD = "page faults per step (x 1000)", "  thread "
#: counts the steps: the first `warmup` calls are not measured
STEP = "Schedule1F1B._step_microbatches"


class CpuProbes:
    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.spent: dict[str, float] = {}
        self.steps = 0
        self._at_warmup: dict[str, float] = {}
        self._at_end: dict[str, float] = {}
        #: wall-clock (start, end) of every measured schedule
        self._schedules: list[tuple[float, float]] = []

    def install(self, strategy: bool) -> None:
        for label, module, path, strategy_only in PARTS:
            if strategy_only and not strategy:
                continue
            owner: Any = importlib.import_module(module)
            *outer, name = path.split(".")
            for part in outer:
                owner = getattr(owner, part)
            setattr(owner, name, self._wrap(label, getattr(owner, name), counts_steps=path == STEP))

    def _wrap(self, label: str, fn: Callable[..., Any], counts_steps: bool) -> Callable[..., Any]:
        spent = self.spent

        @functools.wraps(fn)
        def probed(*args: Any, **kwargs: Any) -> Any:
            if counts_steps:
                self.steps += 1
                if self.steps == self.warmup + 1:
                    self._at_warmup = {**spent, **_counters(), MAIN: time.thread_time(), OTHERS: time.process_time()}
            start, wall = time.thread_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0.0) + time.thread_time() - start
                if counts_steps and self.steps > self.warmup:
                    self._schedules.append((wall, time.perf_counter()))

        return probed

    def mark_end(self) -> None:
        """The measured steps end here (called after each step: the last call counts)."""
        self._at_end = {
            **self.spent,
            **_counters(),
            MAIN: time.thread_time(),
            OTHERS: time.process_time(),
            STEP: self.steps,
        }

    def per_step(self) -> dict[str, float]:
        """CPU milliseconds per measured step, by part (empty unless steps after the warm-up were marked)."""
        before, end = self._at_warmup, self._at_end
        steps = end.get(STEP, 0) - self.warmup
        if steps <= 0 or not before:
            return {}
        main = end[MAIN] - before[MAIN]
        out = {MAIN: main, OTHERS: end[OTHERS] - before[OTHERS] - main}
        out.update({label: end.get(label, 0.0) - before.get(label, 0.0) for label, *_ in PARTS if label in end})
        out.update({k: end[k] - before.get(k, 0.0) for k in end if k.startswith(THREAD) or k == FAULTS})
        per_step = {label: 1000 * seconds / steps for label, seconds in out.items()}
        runs = self._schedules
        if len(runs) > 1:  # medians of wall-clock times (not CPU): the schedule, and from its end to the next one
            per_step[WALL_SCHEDULE] = 1000 * statistics.median(end - start for start, end in runs)
            per_step[WALL_BETWEEN] = 1000 * statistics.median(b[0] - a[1] for a, b in zip(runs, runs[1:]))
        return per_step


def _counters() -> dict[str, float]:
    """This process's minor page faults so far (in millions: per step and x 1000 they read in thousands), and the
    CPU seconds of its threads, summed by thread name (Linux: /proc; elsewhere no threads)."""
    out: dict[str, float] = {FAULTS: resource.getrusage(resource.RUSAGE_SELF).ru_minflt / 1e6}
    tasks = Path("/proc/self/task")
    for task in tasks.iterdir() if tasks.is_dir() else ():
        try:
            name = (task / "comm").read_text().strip()
            nanoseconds = int((task / "schedstat").read_text().split()[0])
        except OSError:  # (a thread that ended meanwhile)
            continue
        out[THREAD + name] = out.get(THREAD + name, 0.0) + nanoseconds / 1e9
    return out


def table(by_impl: dict[str, list[dict[str, float]]]) -> list[str]:
    """Rows of parts, a column per implementation and rank (CPU ms per step), and one with the ranks' sum."""
    threads = sorted({k for ranks in by_impl.values() for parts in ranks for k in parts if k.startswith(THREAD)})
    labels = [MAIN, OTHERS, *threads, *(label for label, *_ in PARTS), FAULTS, WALL_SCHEDULE, WALL_BETWEEN]
    columns = [(impl, rank) for impl, ranks in by_impl.items() for rank in range(len(ranks))]
    head = f"{'CPU ms per step':<32}" + "".join(f"{impl[:5]} r{rank:<3}".rjust(10) for impl, rank in columns)
    head += "".join(f"{impl[:5]} sum".rjust(11) for impl in by_impl)
    lines = [head, "-" * len(head)]
    for label in labels:
        if not any(label in parts for ranks in by_impl.values() for parts in ranks):
            continue
        cells = "".join(f"{by_impl[impl][rank].get(label, 0.0):10.2f}" for impl, rank in columns)
        sums = "".join(f"{sum(parts.get(label, 0.0) for parts in ranks):11.2f}" for ranks in by_impl.values())
        lines.append(f"{label:<32}{cells}{sums}")
    return lines
