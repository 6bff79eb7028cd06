"""Balanced cuts are optimal (checked against brute force), respect memory limits, and say when nothing fits."""

from __future__ import annotations

import itertools
import random

import pytest

from lightning_spot import LayoutError
from lightning_spot.partition.balance import balanced_cuts, stage_times


def brute_force(times, stages, first_extra=0.0, last_extra=0.0, stage_bytes=None, capacity=None):
    best = None
    for cuts in itertools.combinations(range(1, len(times)), stages - 1):
        bounds = [0, *cuts, len(times)]
        if capacity is not None and any(
            stage_bytes(s, a, b) > capacity for s, (a, b) in enumerate(zip(bounds, bounds[1:]))
        ):
            continue
        worst = max(stage_times(times, cuts, first_extra=first_extra, last_extra=last_extra))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_optimal_against_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(2, 9)
    stages = rng.randint(1, n)
    times = [rng.uniform(0.1, 5.0) for _ in range(n)]
    first, last = rng.choice([0.0, rng.uniform(0, 4)]), rng.choice([0.0, rng.uniform(0, 4)])
    mem = [rng.randint(1, 10) for _ in range(n)]
    inflight = rng.randint(0, 3)

    def stage_bytes(stage: int, a: int, b: int) -> float:
        return sum(mem[a:b]) * (1 + inflight * (stages - stage)) / 4

    capacity = rng.choice([None, rng.uniform(5, 40)])
    want = brute_force(times, stages, first, last, stage_bytes, capacity)
    if want is None:
        with pytest.raises(LayoutError, match="fits in"):
            balanced_cuts(times, stages, first_extra=first, last_extra=last, stage_bytes=stage_bytes, capacity=capacity)
        return
    cuts = balanced_cuts(times, stages, first_extra=first, last_extra=last, stage_bytes=stage_bytes, capacity=capacity)
    assert len(cuts) == stages - 1 and cuts == sorted(set(cuts)) and all(0 < c < n for c in cuts)
    assert max(stage_times(times, cuts, first_extra=first, last_extra=last)) == pytest.approx(want)
    bounds = [0, *cuts, n]
    if capacity is not None:
        assert all(stage_bytes(s, a, b) <= capacity for s, (a, b) in enumerate(zip(bounds, bounds[1:])))


def test_heavy_layer_gets_its_own_stage() -> None:
    assert balanced_cuts([1, 1, 6, 1, 1, 1, 1], 3) == [2, 3]
    assert balanced_cuts([1, 1, 1, 1], 2, last_extra=2.0) == [3], "the head's cost counts on the last stage"


def test_memory_limit_moves_the_cut() -> None:
    times = [1, 1, 1, 1]
    unconstrained = balanced_cuts(times, 2)
    assert unconstrained == [2]
    mem = [1, 1, 1, 5]

    def stage_bytes(stage: int, a: int, b: int) -> float:
        return sum(mem[a:b])

    assert balanced_cuts(times, 2, stage_bytes=stage_bytes, capacity=5) == [3]


def test_layer_bigger_than_a_device_is_a_clear_error() -> None:
    with pytest.raises(LayoutError, match=r"No way to cut 3 layers into 3 stages fits in 4\.0 B per device"):
        balanced_cuts([1, 1, 1], 3, stage_bytes=lambda s, a, b: 5.0 * (b - a), capacity=4)
