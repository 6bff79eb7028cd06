"""Bad input gets an error that names the problem and the fix."""

from __future__ import annotations

import pytest
from torch.utils.data import BatchSampler, SequentialSampler

from lightning_spot import Layout, LayoutError, ModelContractError, SpotPipelineStrategy, discover, plan_stages
from lightning_spot.data.sharded import ReplicaBatchSampler
from lightning_spot.partition.placement import tied_parameters
from lightning_spot.runtime.schedules import resolve_schedule
from lightning_spot.strategy.settings import check_supported
from tests.models import NoLayersModel, TiedEmbeddingModel, make_model


def test_pipeline_stages_must_divide_world_size() -> None:
    with pytest.raises(LayoutError, match=r"does not divide the world size 4.*\[1, 2, 4\]"):
        Layout.for_world(4, 3)


def test_auto_layout_uses_the_deepest_pipeline_that_fits() -> None:
    assert Layout.for_world(8, "auto", num_layers=16) == Layout(8, 1)
    assert Layout.for_world(8, "auto", num_layers=3) == Layout(2, 4)
    assert Layout.for_world(6, 3) == Layout(3, 2)


def test_more_stages_than_layers() -> None:
    with pytest.raises(LayoutError, match="need at least 4 layers.*has 3"):
        plan_stages(3, 4)
    with pytest.raises(LayoutError, match="at least 4 layers"):
        plan_stages(3, 2, stages_per_rank=2)


@pytest.mark.parametrize("cuts", [[2], [3, 2], [0, 2], [2, 6]])
def test_bad_cuts(cuts: list[int]) -> None:
    with pytest.raises(LayoutError, match="cuts="):
        plan_stages(6, 3, cuts=cuts)


def test_even_and_explicit_cuts() -> None:
    assert plan_stages(5, 3).cuts == [2, 4]
    assert plan_stages(8, 2, stages_per_rank=2).cuts == [2, 4, 6]
    plan = plan_stages(8, 2, stages_per_rank=2, style="v")
    assert [plan.stages_of_rank(r) for r in range(2)] == [[0, 3], [1, 2]]
    assert plan_stages(6, 3, cuts=[1, 5]).bounds == (0, 1, 5, 6)


def test_unknown_schedule_lists_the_valid_ones() -> None:
    with pytest.raises(LayoutError, match="Unknown pipeline schedule 'zigzag'.*GPipe, 1F1B, Interleaved1F1B"):
        SpotPipelineStrategy(schedule="zigzag")


@pytest.mark.parametrize(
    ("name", "canonical", "per_rank"),
    [
        ("gpipe", "GPipe", 1),
        ("1f1b", "1F1B", 1),
        ("interleaved_1f1b", "Interleaved1F1B", 2),
        ("ZBV", "ZBVZeroBubble", 2),
    ],
)
def test_schedule_names_are_case_insensitive(name: str, canonical: str, per_rank: int) -> None:
    spec = resolve_schedule(name)
    assert (spec.name, spec.stages_per_rank) == (canonical, per_rank)


def test_bad_microbatches_value() -> None:
    with pytest.raises(LayoutError, match="microbatches must be"):
        SpotPipelineStrategy(microbatches=0)


def test_missing_layer_sequence_names_the_fix() -> None:
    with pytest.raises(
        ModelContractError, match="no `nn.Sequential` or `nn.ModuleList` of repeated blocks.*layers='path.to.blocks'"
    ):
        discover(NoLayersModel())
    with pytest.raises(ModelContractError, match="no submodule 'blocks'.*layers='path.to.blocks'"):
        discover(NoLayersModel(), "blocks")
    with pytest.raises(ModelContractError, match="is a Linear"):
        discover(make_model(), "head")


def test_discovery_classifies_surrounding_modules() -> None:
    split = discover(make_model())
    assert split.first_modules == ("embed",) and split.last_modules == ("head",)
    assert split.num_layers == 4
    split = discover(make_model(), last_stage_modules=["embed"])
    assert split.last_modules == ("head", "embed") and split.first_modules == ()


def test_parameters_shared_across_stages_are_found() -> None:
    model = TiedEmbeddingModel()
    split = discover(model)
    (tie,) = tied_parameters(model, split, plan_stages(split.num_layers, 2))
    assert (
        tie.name == "embed.1.weight"
        and tie.aliases == ["head.0.weight"]
        and tie.stages
        == {
            "embed.1.weight": 0,
            "head.0.weight": 1,
        }
    )
    (tie,) = tied_parameters(model, split, plan_stages(split.num_layers, 1))  # one stage: still stored once
    assert not tie.across_stages and tie.aliases == ["head.0.weight"]


def test_global_batch_not_divisible_lists_valid_sizes() -> None:
    batches = BatchSampler(SequentialSampler(range(20)), batch_size=10, drop_last=False)
    sampler = ReplicaBatchSampler(batches, dp_rank=0, dp_size=2, divisor=4)
    with pytest.raises(LayoutError, match=r"multiple of 4 \(e\.g\. \[4, 8, 12, 16\]\)"):
        next(iter(sampler))


def test_fp16_with_optimizer_offload_is_refused() -> None:
    from lightning.pytorch.plugins.precision import MixedPrecision

    with pytest.warns(UserWarning):  # no CUDA here: the scaler warns but is created
        plugin = MixedPrecision("16-mixed", "cuda")
    strategy = SpotPipelineStrategy(precision_plugin=plugin, offload="optimizer")
    with pytest.raises(LayoutError, match="precision='16-mixed' with offload=\\['optimizer'\\] is not supported.*bf16"):
        check_supported(make_model(), strategy.precision_plugin, strategy.settings)
    allowed = SpotPipelineStrategy(precision_plugin=plugin)
    check_supported(make_model(), allowed.precision_plugin, allowed.settings)


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("gpu", "not an offload level"),
        (["optimizer", "disk"], "not an offload level"),
    ],
)
def test_offload_levels_are_checked_when_the_strategy_is_made(value: object, words: str) -> None:
    with pytest.raises(LayoutError, match=words):
        SpotPipelineStrategy(offload=value)  # type: ignore[arg-type]


def test_offloading_the_parameters_implies_the_optimizer() -> None:
    """Weights that rest in host memory are updated there: "parameters" brings "optimizer" with it."""
    assert SpotPipelineStrategy(offload="parameters").settings.requested.offload == ("optimizer", "parameters")
