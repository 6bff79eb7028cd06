"""What a run was worth and what it cost, from its report: the useful-time share (wall time spent on steps that
were kept), GPU-hours by layout, dollars at spot and on-demand prices, dollars per million samples (or tokens),
and what the same training would have cost on-demand without preemptions.

    report = build_report(storage)
    cost = run_cost(report, Prices(spot_per_gpu_hour=1.3, on_demand_per_gpu_hour=4.1))
    print(format_cost(cost))

One process is one GPU. A process is billed from the end of the previous attempt (its machine was being
restarted, rendezvousing, restoring) to the end of its own attempt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: example prices, per GPU-hour: AWS p4d.24xlarge (8 x A100 40 GB) on demand in us-east-1, $32.7726 an hour
#: (https://aws.amazon.com/ec2/instance-types/p4/), and spot at an assumed 70% discount (AWS advertises "up to
#: 90% off"; the real price moves: pass yours)
EXAMPLE_ON_DEMAND = 32.7726 / 8
EXAMPLE_SPOT = EXAMPLE_ON_DEMAND * 0.3


@dataclass(frozen=True)
class Prices:
    """Dollars per GPU-hour, and tokens per sample to quote dollars per million tokens instead of samples."""

    spot_per_gpu_hour: float = EXAMPLE_SPOT
    on_demand_per_gpu_hour: float = EXAMPLE_ON_DEMAND
    tokens_per_sample: int | None = None


def world_of(attempt: dict[str, Any]) -> int:
    """Processes (GPUs) of an attempt's layout."""
    layout = attempt.get("layout_detail") or {}
    if layout.get("world_size"):
        return int(layout["world_size"])
    return int(layout.get("pipeline_stages", 1)) * int(layout.get("data_parallel", 1))


def useful_seconds(attempts: list[dict[str, Any]]) -> float:
    """Time spent on steps that were kept: each attempt's steps up to where the next one resumed, at its pace."""
    total = 0.0
    for i, a in enumerate(attempts):
        start = a.get("resumed_from_step") or 0
        last = a.get("last_step") or 0
        end = (attempts[i + 1].get("resumed_from_step") or 0) if i + 1 < len(attempts) else last
        kept = max(0, min(end, last) - start)
        if kept and a.get("steps_per_second"):
            total += kept / a["steps_per_second"]
    return total


def gpu_seconds_by_layout(attempts: list[dict[str, Any]]) -> dict[str, float]:
    """GPU-seconds each layout held: an attempt's processes from the end of the previous attempt (restarting,
    rendezvousing, restoring) to the end of its own."""
    by_layout: dict[str, float] = {}
    previous_end = None
    for a in attempts:
        end = a["started"] + a["seconds"]
        begin = previous_end if previous_end is not None else a["started"]
        by_layout[a["layout"]] = by_layout.get(a["layout"], 0.0) + (end - begin) * world_of(a)
        previous_end = end
    return by_layout


def samples_trained(attempts: list[dict[str, Any]]) -> int | None:
    """Samples of the steps the run kept (its last step x the global batch); None when no batch size is known."""
    final_step = max((a.get("last_step") or 0 for a in attempts), default=0)
    batch = next((a["global_batch"] for a in reversed(attempts) if a.get("global_batch")), None)
    return final_step * batch if batch else None


def gpu_time_efficiency(attempts: list[dict[str, Any]]) -> float | None:
    """Samples trained / samples its GPU-seconds would have trained at the full cluster's per-GPU speed (the
    attempts on the most GPUs, at their measured speed): goodput against the GPUs the run held, restarts and
    slower layouts charged. None without a measured attempt on the most GPUs."""
    samples = samples_trained(attempts)
    most = max((world_of(a) for a in attempts), default=0)
    full = [a["samples_per_second"] / most for a in attempts if world_of(a) == most and a.get("samples_per_second")]
    held = sum(gpu_seconds_by_layout(attempts).values())
    if not samples or not full or held <= 0:
        return None
    return samples / (held * sum(full) / len(full))


def run_cost(report: dict[str, Any], prices: Prices) -> dict[str, Any]:
    """GPU-hours and dollars of a run (``build_report``'s dict), per layout and in all."""
    attempts = report["attempts"]
    by_layout = {k: v / 3600 for k, v in gpu_seconds_by_layout(attempts).items()}
    gpu_hours = sum(by_layout.values())
    samples = samples_trained(attempts)
    measured = [a for a in attempts if a.get("samples_per_second")]
    reference = max(measured, key=lambda a: a["seconds"]) if measured else None
    on_demand_hours = (
        samples / reference["samples_per_second"] * world_of(reference) / 3600 if samples and reference else None
    )
    spot = gpu_hours * prices.spot_per_gpu_hour
    unit, per = ("tokens", prices.tokens_per_sample) if prices.tokens_per_sample else ("samples", 1)
    return {
        "prices": {
            "spot_per_gpu_hour": prices.spot_per_gpu_hour,
            "on_demand_per_gpu_hour": prices.on_demand_per_gpu_hour,
        },
        "gpu_hours_by_layout": by_layout,
        "gpu_hours": gpu_hours,
        "spot_dollars": spot,
        "on_demand_dollars_same_hours": gpu_hours * prices.on_demand_per_gpu_hour,
        "trained": {"unit": unit, "count": samples * per if samples else None},
        "dollars_per_million": spot / (samples * per / 1e6) if samples else None,
        "on_demand_without_preemptions": {
            "layout": reference["layout"] if reference else None,
            "gpu_hours": on_demand_hours,
            "dollars": on_demand_hours * prices.on_demand_per_gpu_hour if on_demand_hours is not None else None,
        },
        "useful_time_share": report.get("useful_time_share"),
    }


def format_cost(cost: dict[str, Any]) -> str:
    """The cost section of ``lightning-spot report``."""
    p = cost["prices"]
    lines = [
        f"cost         at ${p['spot_per_gpu_hour']:.2f} (spot) / ${p['on_demand_per_gpu_hour']:.2f} (on demand) per GPU-hour",
        f"  GPU-hours  {cost['gpu_hours']:.4f}: "
        + ", ".join(f"{k} {v:.4f}" for k, v in cost["gpu_hours_by_layout"].items()),
        f"  spot       ${cost['spot_dollars']:.4f} (the same hours on demand: ${cost['on_demand_dollars_same_hours']:.4f})",
    ]
    if cost["dollars_per_million"] is not None:
        trained = cost["trained"]
        lines.append(
            f"  per 1M {trained['unit']}: ${cost['dollars_per_million']:.4f} ({trained['count']:,} {trained['unit']} kept)"
        )
    od = cost["on_demand_without_preemptions"]
    if od["dollars"] is not None:
        saving = 1 - cost["spot_dollars"] / od["dollars"] if od["dollars"] else 0.0
        lines.append(
            f"  on demand, no preemptions ({od['layout']} at its measured speed): {od['gpu_hours']:.4f} GPU-hours, "
            f"${od['dollars']:.4f}; spot saved {saving:.0%}"
        )
    return "\n".join(lines)
