"""Cut a layer sequence into contiguous stages that minimise the slowest stage, within a memory budget.

    cuts = balanced_cuts(times=[1, 1, 4, 1, 1, 1], num_stages=2)           # -> [3]: [1,1,4] | [1,1,1]
    cuts = balanced_cuts(times, 3, stage_bytes=lambda stage, a, b: ..., capacity=80 * 2**30)

``stage_bytes(stage, start, stop)`` gives the memory a stage would need to hold layers
``[start, stop)``; it may depend on the stage's position (with 1F1B the first stage keeps more
micro-batches in flight than the last). The search is exact: dynamic programming over
(stages, prefix length), O(num_stages x n^2).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lightning_spot.layout import LayoutError
from lightning_spot.utils.units import format_bytes

StageBytes = Callable[[int, int, int], float]


def stage_times(
    times: Sequence[float], cuts: Sequence[int], *, first_extra: float = 0.0, last_extra: float = 0.0
) -> list[float]:
    """The time of each stage for the given ``cuts`` (extras: work outside the sequence on the first/last stage)."""
    bounds = [0, *cuts, len(times)]
    out = [sum(times[a:b]) for a, b in zip(bounds, bounds[1:])]
    out[0] += first_extra
    out[-1] += last_extra
    return out


def balanced_cuts(
    times: Sequence[float],
    num_stages: int,
    *,
    first_extra: float = 0.0,
    last_extra: float = 0.0,
    stage_bytes: StageBytes | None = None,
    capacity: float | None = None,
) -> list[int]:
    """Exact contiguous partition of ``times`` into ``num_stages`` non-empty stages minimising the maximum
    stage time (ties broken by the smaller total of squared stage times, i.e. a more even spread),
    subject to ``stage_bytes(stage, start, stop) <= capacity`` for every stage.

    Raises :class:`LayoutError` when no partition fits the memory budget.
    """
    n = len(times)
    if num_stages < 1 or num_stages > n:
        raise LayoutError(f"cannot cut {n} layers into {num_stages} non-empty stages")
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + float(t))

    def cost(stage: int, a: int, b: int) -> float:
        c = prefix[b] - prefix[a]
        if stage == 0:
            c += first_extra
        if stage == num_stages - 1:
            c += last_extra
        return c

    def fits(stage: int, a: int, b: int) -> bool:
        return capacity is None or stage_bytes is None or stage_bytes(stage, a, b) <= capacity

    inf = (float("inf"), float("inf"))
    # best[k][i]: (max stage time, sum of squares) for the first i layers in k stages; choice[k][i]: start of stage k-1
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    choice = [[-1] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, num_stages + 1):
        stage = k - 1
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                prev = best[k - 1][j]
                if prev[0] == float("inf") or not fits(stage, j, i):
                    continue
                c = cost(stage, j, i)
                cand = (max(prev[0], c), prev[1] + c * c)
                if cand < best[k][i]:
                    best[k][i] = cand
                    choice[k][i] = j
    if best[num_stages][n][0] == float("inf"):
        raise LayoutError(
            f"No way to cut {n} layers into {num_stages} stages fits in {format_bytes(capacity)} per device. "
            f"Use more pipeline stages, smaller micro-batches, activation checkpointing, or devices with more memory."
        )
    cuts, i = [], n
    for k in range(num_stages, 1, -1):
        i = choice[k][i]
        cuts.append(i)
    return sorted(cuts)
