"""The pipeline timeline: complete, well-formed traces for every schedule, a Gantt PNG, bubble figures."""

from __future__ import annotations

import io
import json
from collections import Counter
from typing import Any

import pytest

from lightning_spot.runtime.schedules import SCHEDULE_NAMES, resolve_schedule, theoretical_bubble
from tests.parity import run_scenarios

RECORDED = [1, 2]  # the traced global steps


MICROBATCHES = 4


def _scenario(schedule: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": schedule,
        "strategy": {"pipeline_stages": 2, "microbatches": MICROBATCHES, "schedule": schedule},
        "model": {"num_layers": 8},
        "loader": {"batch_size": 16, "n": 64},
        "trainer": {"max_steps": 3},
        "timeline": {
            "start_step": RECORDED[0],
            "num_steps": len(RECORDED),
            "gantt": schedule in ("1F1B", "ZBVZeroBubble"),
        },
        "throughput": {"warmup_steps": 0},
        **extra,
    }


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every schedule on P2xD1, and 1F1B on P2xD2 with SpotCheckpoint (all-reduce and checkpoint events)."""
    tmp = tmp_path_factory.mktemp("timeline")
    two = run_scenarios(2, [_scenario(s) for s in SCHEDULE_NAMES], tmp / "w2", timeout=400)
    ddp = _scenario(
        "1F1B",
        name="P2D2-1F1B-checkpointed",
        spot_checkpoint={"dirpath": str(tmp / "w4" / "run"), "every_n_train_steps": 1, "snapshots": False},
    )
    four = run_scenarios(4, [ddp], tmp / "w4", timeout=300)
    return {
        "results": {**two, **four},
        "dirs": {**{s: tmp / "w2" / "out" / s for s in SCHEDULE_NAMES}, ddp["name"]: tmp / "w4" / "out" / ddp["name"]},
    }


def _trace(traced: dict[str, Any], name: str) -> dict[str, Any]:
    return json.loads((traced["dirs"][name] / "timeline" / "trace.json").read_text())


def _x(trace: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_trace_has_every_microbatch_forward_and_backward_on_every_stage(traced: dict[str, Any], schedule: str) -> None:
    trace = _trace(traced, schedule)
    events = _x(trace)
    for e in events:  # well-formed Chrome-trace complete events
        assert {"name", "cat", "ph", "ts", "dur", "pid", "tid"} <= e.keys(), e
        assert isinstance(e["ts"], float) and e["dur"] >= 0 and e["pid"] in (0, 1)
    spec = resolve_schedule(schedule)
    stages = 2 * spec.stages_per_rank
    steps = [e for e in events if e["cat"] == "step"]
    assert sorted(e["args"]["step"] for e in steps if e["pid"] == 0) == RECORDED
    compute = Counter(
        (e["cat"], e["args"]["stage"], e["args"]["microbatch"])
        for e in events
        if e["cat"] in ("forward", "backward", "weight") and "part" not in e["args"]
    )
    last_stage_work = Counter(e["args"]["microbatch"] for e in events if e["args"].get("part") == "layers and loss")
    assert last_stage_work == {mb: len(RECORDED) for mb in range(MICROBATCHES)}, last_stage_work
    assert all(e["args"]["stage"] == stages - 1 for e in events if e["args"].get("part"))
    for stage in range(stages):
        for mb in range(MICROBATCHES):
            assert compute[("forward", stage, mb)] == len(RECORDED), (schedule, stage, mb, compute)
            assert compute[("backward", stage, mb)] == len(RECORDED), (schedule, stage, mb, compute)
            if spec.splits_backward:  # zero-bubble: the weight gradient runs as its own action (or with the input one)
                assert compute[("weight", stage, mb)] <= len(RECORDED)
    if spec.splits_backward:
        assert any(k[0] == "weight" for k in compute), f"{schedule}: no separate weight-gradient action traced"
    # each stage sits on the rank the layout puts it on
    owner = {(e["args"]["stage"]): e["pid"] for e in events if e["cat"] == "forward"}
    assert len(set(owner.values())) == 2
    # pipeline communication and the optimizer are there too, on both ranks
    cats = Counter((e["cat"], e["pid"]) for e in events)
    for rank in (0, 1):
        assert cats[("recv", rank)] > 0 and cats[("optimizer", rank)] == len(RECORDED), (schedule, cats)
    # every traced action of a step lies inside that step on its rank
    for e in events:
        if e["cat"] in ("forward", "backward", "weight", "recv"):
            assert any(
                s["pid"] == e["pid"] and s["ts"] - 1 <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1
                for s in steps
            ), e


@pytest.mark.slow
def test_ddp_allreduce_and_checkpoints_are_traced(traced: dict[str, Any]) -> None:
    events = _x(_trace(traced, "P2D2-1F1B-checkpointed"))
    assert {e["pid"] for e in events} == {0, 1, 2, 3}
    allreduce = [e for e in events if e["cat"] == "allreduce"]
    assert {e["pid"] for e in allreduce} == {0, 1, 2, 3} and all(
        e["tid"] == "allreduce" and e["args"]["bytes"] > 0 for e in allreduce
    )
    copies = [e for e in events if e["name"] == "checkpoint copy"]
    uploads = [e for e in events if e["name"] == "checkpoint upload"]
    assert {e["args"]["step"] for e in copies} >= {2} and uploads, Counter(e["name"] for e in events)
    assert _trace(traced, "P2D2-1F1B-checkpointed")["metadata"]["layout"]["data_parallel"] == 2


@pytest.mark.slow
def test_gantt_png_is_drawn_and_not_trivial(traced: dict[str, Any]) -> None:
    mpl_image = pytest.importorskip("matplotlib.image")
    for name in ("1F1B", "ZBVZeroBubble"):
        data = (traced["dirs"][name] / "timeline" / "timeline.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
        pixels = mpl_image.imread(io.BytesIO(data), format="png")
        colours = {tuple(p) for p in pixels.reshape(-1, pixels.shape[-1])[::7].round(2).tolist()}
        assert len(colours) > 20, "the chart should show several coloured actions"
    assert not (traced["dirs"]["GPipe"] / "timeline" / "timeline.png").exists()  # gantt=False


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "ZBVZeroBubble"])
def test_bubble_figures_are_logged(traced: dict[str, Any], schedule: str) -> None:
    rank0 = traced["results"][schedule][0]
    stats = rank0["pipeline_stats"]
    spec = resolve_schedule(schedule)
    assert stats["layout"] == "P2xD1" and stats["microbatches"] == MICROBATCHES
    assert stats["bubble_theory"] == pytest.approx(theoretical_bubble(schedule, 2, spec.stages_per_rank, MICROBATCHES))
    assert 0.0 < stats["bubble"] < 1.0 and 0.0 < stats["compute_seconds"] < stats["pipeline_seconds"]
    metrics = rank0["metrics"]
    assert metrics["pipeline/bubble"] == pytest.approx(stats["bubble"], rel=1e-4)
    assert metrics["pipeline/bubble_theory"] == pytest.approx(stats["bubble_theory"], rel=1e-4)
    assert metrics["throughput/samples_per_sec"] > 0 and "bubble" in rank0["throughput"]
