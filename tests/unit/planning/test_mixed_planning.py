"""Pipelines of mixed depths, without processes: the layout, the batch split, the planner's choice, bad input."""

from __future__ import annotations

import pytest

from lightning_spot import LayoutError, SpotPipelineStrategy
from lightning_spot.data.sharded import ReplicaBatchSampler, replica_slice
from lightning_spot.layout import Layout, PipelineLayout
from lightning_spot.planning.choose import Requested, _decide
from lightning_spot.planning.cost_model import plan_layouts
from lightning_spot.planning.hardware import Hardware
from lightning_spot.planning.mixed import depth_mixes, plan_mixed, split_microbatches, total_microbatches
from lightning_spot.planning.profile import LayerProfile
from tests.unit.planning.test_planner import MB, transformer


def test_mixed_grid_places_each_pipeline_on_consecutive_ranks() -> None:
    grid = Layout.for_world(5, [2, 3])
    assert str(grid) == "P2+P3" and grid.is_mixed and grid.world_size == 5
    assert [grid.pipeline_ranks(p) for p in range(2)] == [[0, 1], [2, 3, 4]]
    assert [(grid.dp_rank(r), grid.pp_rank(r)) for r in range(5)] == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    assert Layout.for_world(4, [2, 2]) == Layout(2, 2)  # equal depths are the usual grid
    uniform = Layout(2, 3)
    assert [uniform.rank_of(uniform.dp_rank(r), uniform.pp_rank(r)) for r in range(6)] == list(range(6))


@pytest.mark.parametrize(
    ("world", "stages", "words"),
    [
        (5, [2, 2], "add up to 5"),
        (4, [0, 4], "positive depth"),
        (7, 4, "pipeline_stages=[4, 3]"),  # the error for a depth that does not divide offers a mix
    ],
)
def test_depths_that_do_not_fit_the_world_name_the_fix(world: int, stages: object, words: str) -> None:
    with pytest.raises(LayoutError, match=words.replace("[", r"\[").replace("]", r"\]")):
        Layout.for_world(world, stages)  # type: ignore[arg-type]


def test_microbatch_lists_need_a_depth_list() -> None:
    with pytest.raises(LayoutError, match="one count per pipeline"):
        SpotPipelineStrategy(pipeline_stages=2, microbatches=[3, 5])
    with pytest.raises(LayoutError, match="one count per pipeline"):
        SpotPipelineStrategy(pipeline_stages=[2, 3], microbatches=[3])
    with pytest.raises(LayoutError, match="positive"):
        SpotPipelineStrategy(pipeline_stages=[2, 3], microbatches=[3, 0])


def test_layout_records_round_trip() -> None:
    layout = PipelineLayout.mixed(Layout.of_depths([1, 3]), "GPipe", [[], [1, 3]], [2, 6])
    assert layout.total_microbatches == 8 and layout.microbatches_of(1) == 6 and layout.cuts_of(1) == (1, 3)
    assert PipelineLayout.from_dict(layout.to_dict()) == layout
    assert layout.to_dict()["pipelines"][1] == {"depth": 3, "cuts": [1, 3], "microbatches": 6}


def test_faster_pipelines_get_more_microbatches_and_the_slowest_finishes_first() -> None:
    # a depth-3 pipeline's slowest stage takes 1/3 as long: it gets most micro-batches
    assert split_microbatches(8, [1, 3], [3.0, 1.0]) == [2, 6]
    # each pipeline gets at least what 1F1B needs (one per stage), however slow
    assert split_microbatches(5, [2, 3], [100.0, 1.0]) == [2, 3]
    assert split_microbatches(4, [2, 3], [1.0, 1.0], schedule="GPipe") == [2, 2]
    with pytest.raises(LayoutError, match="at least 5"):
        split_microbatches(4, [2, 3], [1.0, 1.0])
    # auto: two micro-batches per process at least, and a divisor of the global batch
    assert total_microbatches([2, 3], "1F1B", 64) == 16
    assert total_microbatches([2, 3], "1F1B", 60) == 10


def test_weighted_shares_follow_the_microbatch_split() -> None:
    assert [replica_slice(16, r, 2, [1, 3]) for r in range(2)] == [slice(0, 4), slice(4, 16)]
    sampler = ReplicaBatchSampler([list(range(16))], 1, 2, divisor=8, weights=[3, 5])
    assert list(sampler) == [list(range(6, 16))]
    with pytest.raises(LayoutError, match="multiple of 8"):
        list(ReplicaBatchSampler([list(range(12))], 0, 2, divisor=8, weights=[3, 5]))


def test_depth_mixes_use_every_process() -> None:
    assert depth_mixes(5, 4)[0] == [2, 3]
    assert all(sum(m) == 7 and len(set(m)) == 2 for m in depth_mixes(7, 7))


def _memory_bound_uneven_model():
    """Six layers, the first costing 4x the others; too big for one device (each layer 1 GB of state)."""
    profile = transformer(6, param_mb=256, saved_mb=8)
    first = profile.layers[0]
    heavy = LayerProfile(
        4 * first.forward_s, 4 * first.backward_s, first.param_bytes, first.saved_bytes, first.output_bytes
    )
    profile.layers = [heavy, *profile.layers[1:]]
    return profile


ROOMY_NET = Hardware(memory_bytes=5 * 2**30, p2p_bytes_per_s=50e9, allreduce_bytes_per_s=50e9)


def test_planner_picks_a_mix_when_it_beats_every_uniform_layout() -> None:
    """5 devices, a model needing >= 2 stages: uniform can only be P5xD1, whose slowest stage is the heavy layer
    anyway; two pipelines [2, 3] share the batch and finish it much sooner."""
    profile = _memory_bound_uneven_model()
    uniform = plan_layouts(profile, world_size=5, global_batch=40, hardware=ROOMY_NET)[0]
    assert uniform.pipeline_stages == 5
    best = plan_mixed(profile, world_size=5, global_batch=40, hardware=ROOMY_NET)[0]
    assert sorted(best.depths) == [2, 3] and best.samples_per_second > 1.3 * uniform.samples_per_second
    assert best.microbatches[best.depths.index(3)] > best.microbatches[best.depths.index(2)]  # the faster one
    draft = _decide(profile, Requested("auto", "auto", "auto", "auto", None, None, None), 5, 40, ROOMY_NET)
    assert sorted(draft.pipeline_stages) == [2, 3]  # type: ignore[arg-type]
    assert "faster than the best uniform layout, P5xD1" in draft.reason and "runner-up" in draft.reason


def test_planner_keeps_a_uniform_layout_when_it_is_as_good() -> None:
    profile = transformer(8, param_mb=1)
    draft = _decide(profile, Requested("auto", "auto", "auto", "auto", None, None, None), 4, 32, ROOMY_NET)
    assert isinstance(draft.pipeline_stages, int)


def test_planner_says_when_idling_a_process_would_be_faster() -> None:
    """Four equal layers, at most two per device: on 5 processes only [2, 3] fits, and its depth-3 pipeline is no
    faster than a depth-2 one (its slowest stage still has two layers), so a uniform layout on 4 of the 5
    processes is predicted faster. The planner keeps every process training and says so."""
    profile = transformer(4, param_mb=256, saved_mb=1)
    small = LayerProfile(1e-4, 1e-4, MB, MB, 4 * MB)
    profile.first, profile.last = small, small
    hw = Hardware(memory_bytes=2.5 * 2**30, p2p_bytes_per_s=50e9, allreduce_bytes_per_s=50e9)
    draft = _decide(profile, Requested("auto", "auto", "auto", "auto", None, None, None), 5, 40, hw)
    assert sorted(draft.pipeline_stages) == [2, 3]  # type: ignore[arg-type]
    assert "no uniform layout of 5 processes fits" in draft.reason
    assert "on 4 of the 5 processes is predicted" in draft.reason, draft.reason


def test_a_mix_can_balance_better_than_any_uniform_layout() -> None:
    """8 equal layers and a head as costly as one: 9 units cut into 4 stages leave a slowest stage of 3 in every
    P4xD2, while pipelines [3, 5] have slowest stages of 3 and 2 and split the batch 3 : 5."""
    from tests.unit.planning.test_plan_stability import HARDWARE, profile

    draft = _decide(profile(), Requested("auto", "auto", "auto", "auto", None, None, None), 8, 64, HARDWARE)
    assert draft.pipeline_stages == [3, 5] and draft.microbatches == [3, 5], draft.reason
