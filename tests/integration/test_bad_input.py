"""Bad input found only when a job runs: an error that names the problem and the fix, on every rank."""

from __future__ import annotations

import json
import re

import pytest

from tests.distributed import launch


@pytest.fixture(scope="module")
def errors_on_every_rank(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    tmp = tmp_path_factory.mktemp("errors")
    launch(2, ["tests/workers/expect_errors.py", str(tmp / "out")], log_dir=tmp / "logs", timeout=300)
    return [json.loads((tmp / "out" / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize(
    ("name", "pattern"),
    [
        ("stages-do-not-divide-world", r"LayoutError: pipeline_stages=3 does not divide the world size 2"),
        ("more-stages-than-layers", r"LayoutError: 2 pipeline stages .* need at least 2 layers"),
        ("no-layer-sequence", r"ModelContractError: .*no `nn.Sequential` or `nn.ModuleList` of repeated blocks"),
        ("global-batch-not-divisible", r"LayoutError: A global batch of 12 samples .* multiple of 8"),
        ("manual-optimization", r"ModelContractError: .*needs automatic optimization"),
    ],
)
def test_trainer_reports_bad_input_on_every_rank(
    errors_on_every_rank: list[dict[str, str]], name: str, pattern: str
) -> None:
    for rank_errors in errors_on_every_rank:
        assert rank_errors[name] != "no error"
        assert re.search(pattern, rank_errors[name], flags=re.S), rank_errors[name]


def test_parameters_unfrozen_after_setup_with_streamed_weights_are_refused(
    errors_on_every_rank: list[dict[str, str]],
) -> None:
    """BackboneFinetuning unfreezes a module that offload="parameters" does not stream: the rank that holds it says
    so at the first step, and every rank stops."""
    errors = [rank_errors["unfrozen-after-setup-with-streamed-weights"] for rank_errors in errors_on_every_rank]
    assert "no error" not in errors
    assert re.search(r"became trainable after spot_pipeline set up.*offload='parameters'", errors[0], flags=re.S)
