"""The spot-trace replay of ``spot_replay.py`` with ``fault_tolerance="torchft"``: survivors keep training.

Used by ``python benchmarks/spot_replay.py ... --fault-tolerance``. Each node of the trace is one pipeline (one
CPU process) under a torchrun of its own (a rendezvous per node, never one spanning nodes), all joined by a torchft
lighthouse that this script runs (spot timeouts: heartbeat 1 s). A node that joins takes a live pipeline's state
and trains its share of the next step; a node that leaves with a notice (SIGTERM to its torchrun) leaves the quorum
at once; one killed without notice is dropped from the quorum after a heartbeat timeout, and the step it was in
is run again by the others. The first node stays (as in the restart replay), so its pipeline's step times tell
the useful time: each step at most as long as the median of the steps around it counts as useful, the rest of
the wall time (setup, the time a kill or a join held the step up, steps run again) as lost.
"""

from __future__ import annotations

import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

#: steps on either side whose median is a step's usual duration (the pace changes with the number of pipelines)
WINDOW = 10


def replay_ft(
    events: list[tuple[float, int, str]], steps: int, step_seconds: float, out: Path, *, step_gpu_seconds: float = 0.0
) -> dict[str, Any]:
    """Run the replay in ``out``: a lighthouse here, one torchrun (one pipeline) per node of the trace;
    ``step_gpu_seconds``: a step's work, shared by the pipelines of the quorum."""
    from benchmarks.spot_replay import replay_config
    from lightning_spot_launch.lighthouse import start_lighthouse
    from tests.distributed import free_port
    from tests.elastic import Agent

    if any(how == "m" for _, _, how in events):
        raise SystemExit("--fault-tolerance replays notices as SIGTERM (s) or kills (k); --notice m is not supported")
    strategy = {"profile_cache": None, "fault_tolerance": "torchft", "microbatches": 2}
    config = replay_config(out, steps, step_seconds, strategy=strategy, step_gpu_seconds=step_gpu_seconds)
    args = ["tests/workers/elastic_train.py", str(out / "config.json")]
    lighthouse = start_lighthouse()
    address = lighthouse.address()
    nodes: list[Agent] = []
    departed: set[str] = set()
    log: list[dict[str, Any]] = []
    started, epoch, count = time.monotonic(), time.time(), 0
    try:
        pending = sorted(events, key=lambda e: e[0])
        while nodes == [] or nodes[0].proc.poll() is None:
            now = time.monotonic() - started
            while pending and pending[0][0] <= now:
                _, change, how = pending.pop(0)
                alive = [n for n in nodes if n.proc.poll() is None and n.name not in departed]
                if change > 0:
                    count += 1
                    env = {"TORCHFT_LIGHTHOUSE": address, "REPLICA_GROUP_ID": str(count - 1)}
                    name, log_path = f"node-{count}", out / f"node-{count}.log"
                    nodes.append(Agent(name, free_port(), 1, args, log_path, "1:1", env, max_restarts=100))
                    log.append({"time": now, "event": "join", "node": count, "nodes": len(alive) + 1})
                elif len(alive) > 1:
                    victim = alive[-1]  # the newest node leaves; the first one stays
                    departed.add(victim.name)
                    victim.signal(signal.SIGTERM) if how == "s" else victim.kill_node()
                    log.append(
                        {
                            "time": now,
                            "wall": time.time(),
                            "event": "leave",
                            "notice": how == "s",
                            "source": "SIGTERM" if how == "s" else None,
                            "node": victim.name,
                            "nodes": len(alive) - 1,
                        }
                    )
            time.sleep(0.1)
        wall = time.monotonic() - started
        ok = nodes[0].proc.returncode == 0
        if not ok:
            print(nodes[0].output()[-4000:], file=sys.stderr)
    finally:
        for n in nodes:
            n.kill()
        lighthouse.shutdown()
    return {"events": log, "wall_seconds": wall, "ok": ok, "config": config, "epoch": epoch}


def useful_share(ended: list[float], t0: float) -> tuple[float, float, list[float]]:
    """(useful seconds, wall seconds from ``t0`` to the last step, each step's usual duration) of one pipeline's
    step end times: a step counts as useful up to the median duration of the ``WINDOW`` steps on either side."""
    gaps = [b - a for a, b in zip(ended, ended[1:])]
    usual = [statistics.median(gaps[max(0, i - WINDOW) : i + WINDOW + 1]) for i in range(len(gaps))]
    return sum(min(g, u) for g, u in zip(gaps, usual)), ended[-1] - t0, usual


def figures_ft(out: Path, result: dict[str, Any]) -> dict[str, Any]:
    """Useful time from pipeline 0 (the node that stays), what each leave and join cost it, the quorum summary
    of its history, and its final parameters against an uninterrupted single-process run."""
    import torch

    from lightning_spot.checkpoint.durable.storage import Storage
    from lightning_spot.observe.run_report import build_report
    from tests.parity import reference_run

    report = build_report(Storage(str(out / "run" / "pipeline-0")))
    final = torch.load(out / "out" / "final" / "pipeline-0" / "rank0.pt")
    ended = [e[1] for e in final["ended"]]
    useful, wall, usual = useful_share(ended, report["started_epoch"])
    costs = []
    for e in result["events"]:
        at = result["epoch"] + e["time"]
        if at <= ended[0]:
            continue  # before pipeline 0's first step (the nodes of the start)
        i = next((i for i, t in enumerate(ended[1:]) if t > at), None)
        if i is not None:  # the step under way when the event came, and the next one (a kill's step is run again)
            held = sum(max(0.0, ended[j + 1] - ended[j] - usual[j]) for j in range(i, min(i + 2, len(usual))))
            costs.append({**e, "held_seconds": held, "step": final["ended"][i + 1][0]})
    config = result["config"]
    ref = reference_run(
        {"model": config["model"], "loader": config["loader"], "trainer": {"max_steps": config["max_steps"]}}
    )
    got = final["state_dict"]
    worst = max((got[k] - ref["state_dict"][k]).abs().max().item() for k in ref["state_dict"])
    return {
        "useful_time_share": useful / wall,
        **ft_goodput(final["ended"], result, report["started_epoch"]),
        "useful_seconds": useful,
        "wall_seconds": wall,
        "setup_seconds": ended[0] - report["started_epoch"],
        "median_step_seconds": statistics.median(usual),
        "events_held": costs,
        "fault_tolerance": report["fault_tolerance"],
        "restarts": len(report["restarts"]),
        "max_param_difference": worst,
    }


def ft_goodput(ended: list[Any], result: dict[str, Any], started_epoch: float) -> dict[str, Any]:
    """GPU-time efficiency over pipeline 0's window (its history's start to its last step, the useful-time
    share's): the steps trained, at the step time pipeline 0 measured while every node's pipeline was in the
    quorum, against the node-seconds the trace gave (a joiner's start-up and a leaver's last seconds charged)."""
    from benchmarks.goodput import figures, node_seconds, peak_nodes, step_seconds_by_size

    log = result["events"]
    start, end = started_epoch - result["epoch"], ended[-1][1] - result["epoch"]
    by_size = step_seconds_by_size(ended) if ended and len(ended[0]) > 2 else {}
    return figures(ended[-1][0], by_size, peak_nodes(log), node_seconds(log, start, end))


def print_ft(label: str, result: dict[str, Any], fig: dict[str, Any]) -> None:
    print(f"replay of {label} with torchft: {len(result['events'])} events, {result['wall_seconds']:.1f} s")
    for e in fig["events_held"]:
        how = "" if e["event"] == "join" else (" (SIGTERM notice)" if e["notice"] else " (killed, no notice)")
        print(
            f"  {e['time']:6.1f}s  {e['event']}{how} -> {e['nodes']} nodes; pipeline 0 held up "
            f"{e['held_seconds']:.2f} s (step {e['step']})"
        )
    for kind in ("join", "notice", "kill"):
        held = [
            e["held_seconds"]
            for e in fig["events_held"]
            if (e["event"] == "join") == (kind == "join") and (kind == "join" or e["notice"] == (kind == "notice"))
        ]
        if held:
            print(f"  {kind}: pipeline 0 held up {statistics.mean(held):.2f} s on average ({len(held)} events)")
    ft = fig["fault_tolerance"] or {}
    print(
        f"useful-time share {fig['useful_time_share']:.1%} of pipeline 0's {fig['wall_seconds']:.1f} s from its "
        f"history's start (first step after {fig['setup_seconds']:.1f} s; median step {fig['median_step_seconds'] * 1000:.0f} ms); restarts of "
        f"pipeline 0 {fig['restarts']}; quorum changes {ft.get('quorum_changes', 0)}, steps run again "
        f"{ft.get('steps_run_again', 0)}, {ft.get('seconds_with_fewer_pipelines', 0.0):.1f} s with fewer pipelines"
    )
    from benchmarks.spot_replay import goodput_line

    print(goodput_line(fig))
    print(f"final parameters vs an uninterrupted run: max difference {fig['max_param_difference']:.2e}")
