"""Replay a spot-availability trace against real training: nodes join and leave as the trace says.

Each node is a loopback torchrun agent with one CPU process (``tests/elastic.py``), training the test model
(``tests/workers/elastic_train.py``) under ``spot_pipeline`` with everything "auto", ``SpotCheckpoint`` with
in-memory snapshots and durable checkpoints in a local directory. The trace's time is compressed by
``--compress`` (trace seconds per replay second) and its node count capped at ``--cap`` (what this machine
holds) and floored at one: the first node hosts the rendezvous and stays; a leaving node is the newest one. A
leave comes with the notice its cloud would give (SIGTERM to the node's agent, which forwards it to the
workers: a coordinated stop with a checkpoint) or with none (the node's processes SIGKILLed), alternating
by default (``--notice``); ``--notice m`` gives every node its own stand-in AWS metadata service
(``tests/metadata_server.py``) that announces a spot interruption, and kills the node when the notice's lead
time (``--lead``, 2 minutes, compressed like the trace) is over. A leave that falls while the group is restarting waits until it trains again:
torchrun's rendezvous does not survive a member dying inside a round (the survivors time out), so replaying
it would measure that, not us; the log gives each leave's delay. When training ends the script reads the run's history (``lightning-spot report``)
and prints the useful-time share (time on steps that were kept / wall time), restarts, steps recomputed, time
per recovery phase, throughput per layout, and compares the final parameters with an uninterrupted
single-process run of the same steps (CPU: within 1e-5).

Usage::

    python benchmarks/spot_replay.py --trace aws-spot-instances-g4dn-xlarge-us-east-1c-2020-11-20-1930-to-2020-11-21-2200 \\
        --compress 800 --from-hours 5.9 --hours 3
    python benchmarks/spot_replay.py --fixed-rate 4,600,3600 --compress 60      # Oobleck: a node lost every 10 min
    python benchmarks/spot_replay.py --events "0:+3,20:-1s,40:-1k,60:+1" --steps 80   # a synthetic trace

The agents run with ``OMP_NUM_THREADS=1`` (``tests/elastic.py``): several stand-in "nodes" share this
machine's cores, which a real node would not.

``--fault-tolerance``: the same replay with ``fault_tolerance="torchft"`` (``benchmarks/ft_replay.py``): every node a
pipeline of its own, survivors keep training, useful time from the first node's step times.

Traces: ``benchmarks/data/spot_traces/`` (Bamboo's AWS traces; ``python benchmarks/spot_traces.py`` lists them).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.spot_traces import Trace, fixed_rate, load_trace  # noqa: E402


def parse_events(text: str) -> list[tuple[float, int, str]]:
    """``"0:+3,20:-1s,40:-1k,60:+1,80:-1m"``: at replay second t, nodes join (+n) or leave (-n) with a SIGTERM
    notice (``s``), killed without one (``k``), or announced by their cloud's metadata service and killed when
    its lead time has passed (``m``: AWS's spot instance-action, 2 minutes, compressed like the trace)."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        t, change = item.split(":")
        how = change[-1] if change[-1] in "skm" else "s"
        n = int(change.rstrip("skm"))
        out += [(float(t), 1 if n > 0 else -1, how)] * abs(n)
    return out


def trace_events(trace: Trace, *, cap: int, compress: float, start: float, span: float, notice: str):
    """Replay events (replay seconds, +1/-1, notice) of a trace window, node count within [1, cap]."""
    events, current, leaves = [], 0, 0
    want0 = max(1, min(cap, trace.at(start)))
    events += [(0.0, +1, "s")] * want0
    current = want0
    for t, n in zip(trace.times, trace.counts):
        if t <= start or t > start + span:
            continue
        target = max(1, min(cap, n))
        while current != target:
            if target > current:
                events.append(((t - start) / compress, +1, "s"))
                current += 1
            else:
                how = notice if notice in ("s", "k", "m") else ("s" if leaves % 2 == 0 else "k")
                events.append(((t - start) / compress, -1, how))
                current -= 1
                leaves += 1
    return events


def training(run: Path, after: int = 0, world: int | None = None) -> bool:
    """Whether the group is training: its newest attempt (one of those after the first ``after``; on ``world``
    processes, if given) has taken a step (the run's history says so)."""
    from lightning_spot.checkpoint.durable.journal import read_events
    from lightning_spot.checkpoint.durable.storage import Storage

    if not run.exists():
        return False
    events = read_events(Storage(str(run)))
    kinds = [e["kind"] for e in events]
    if kinds.count("start") <= after:
        return False
    last_start = len(kinds) - 1 - kinds[::-1].index("start")
    layout = events[last_start].get("layout") or {}
    if world is not None and layout.get("world_size") != world:
        return False  # the group has not taken in every node yet (one came too late for the rendezvous round)
    return "first_step" in kinds[last_start:] and kinds[-1] not in ("preempted", "end")


def attempts(run: Path) -> int:
    """How many attempts the run's history has started."""
    from lightning_spot.checkpoint.durable.journal import read_events
    from lightning_spot.checkpoint.durable.storage import Storage

    return [e["kind"] for e in read_events(Storage(str(run)))].count("start") if run.exists() else 0


def replay_config(out: Path, steps: int, step_seconds: float, **extra: Any) -> dict[str, Any]:
    """The worker's configuration (``tests/workers/elastic_train.py``), also written to ``out/config.json``: the
    test model, 80 shuffled samples in batches of 16, durable checkpoints every 5 steps; ``extra`` adds to it."""
    config = {
        "model": {"scheduler": True},
        "loader": {"batch_size": 16, "n": 80, "shuffle": True},
        "out": str(out / "out"),
        "run": str(out / "run"),
        "max_steps": steps,
        "step_seconds": step_seconds,
        "every": 5,
        "keep_last": 2,
        "strategy": {"profile_cache": None},
        **extra,
    }
    (out / "config.json").write_text(json.dumps(config))
    return config


def replay(
    events: list[tuple[float, int, str]],
    steps: int,
    step_seconds: float,
    out: Path,
    *,
    settle: bool = False,
    keep_alive: int | None = None,
    last_call: int | None = None,
    lead_seconds: float = 4.0,
    step_gpu_seconds: float = 0.0,
) -> dict[str, Any]:
    """Run the replay in ``out``; with ``settle`` each event waits until the group trains again, on every node
    that is a member, after the restart the previous event caused (one restart per event: for tests), else only
    leaves wait, until it trains. ``keep_alive``: the rendezvous's keep-alive interval in seconds (3 missed beats
    decide how soon a node that died is given up), ``last_call``: how long a round waits for more nodes; both
    ``lightning-spot run``'s defaults unless given.
    ``lead_seconds``: how long after a metadata notice (``m``) the node is killed (AWS's 2 minutes, compressed).
    ``step_gpu_seconds``: a step's work, shared by the processes that train it (added to ``step_seconds``)."""
    from lightning_spot_launch.run import KEEP_ALIVE_SECONDS, LAST_CALL_SECONDS, rendezvous_conf
    from tests.distributed import free_port
    from tests.elastic import Agent, port_open, wait_for

    config = replay_config(out, steps, step_seconds, snapshot_every=1, step_gpu_seconds=step_gpu_seconds)
    args = ["tests/workers/elastic_train.py", str(out / "config.json")]
    port = free_port()
    rdzv_conf = "join_timeout=120," + rendezvous_conf(keep_alive or KEEP_ALIVE_SECONDS, last_call or LAST_CALL_SECONDS)
    nodes: list[Agent] = []
    departed: set[str] = set()
    metadata = any(how == "m" for _, _, how in events)  # every node gets a metadata service to announce its end
    servers: dict[str, subprocess.Popen] = {}
    doomed: dict[str, float] = {}  # node -> when the cloud takes it (after a metadata notice)
    log: list[dict[str, Any]] = []
    started = time.monotonic()
    epoch = time.time()  # wall clock of the replay's start: the run's history is in wall-clock time
    count = 0
    settled = 0  # with settle: attempts started before the last event (the next one waits for a newer one)
    try:
        pending = sorted(events, key=lambda e: e[0])
        while True:
            now = time.monotonic() - started
            while pending and pending[0][0] <= now:
                members = len([n for n in nodes if n.proc.poll() is None and n.name not in departed])
                if (
                    (pending[0][1] < 0 or settle)
                    and pending[0][0] > 0
                    and not training(out / "run", settled, members if settle else None)
                ):
                    break  # a leave during a restart waits for the group to train again (see the module doc)
                due, change, how = pending.pop(0)
                if settle and due > 0:  # the next event waits for the restart this one causes
                    settled = attempts(out / "run")
                now = time.monotonic() - started  # reading the run's history took a while (imports, the first time)
                alive = [n for n in nodes if n.proc.poll() is None and n.name not in departed]
                if change > 0:
                    count += 1
                    env = {"SPOT_TEST_SNAPSHOT_DIR": str(out / f"shm-{count}")}
                    if metadata:
                        meta_port = free_port()
                        servers[f"node-{count}"] = subprocess.Popen(
                            [
                                sys.executable,
                                "tests/metadata_server.py",
                                "--cloud",
                                "aws",
                                "--port",
                                str(meta_port),
                                "--trigger",
                                str(out / f"notice-{count}"),
                            ],
                            cwd=REPO,
                        )
                        env["SPOT_TEST_AWS_METADATA"] = f"http://127.0.0.1:{meta_port}"
                    nodes.append(
                        Agent(
                            f"node-{count}",
                            port,
                            1,
                            args,
                            out / f"node-{count}.log",
                            "1:16",
                            env,
                            max_restarts=100,
                            rdzv_conf=rdzv_conf,
                        )
                    )
                    if count == 1:  # the first node hosts the rendezvous store: it must be up before the others
                        wait_for(lambda: port_open(port), 60, "the first node to host the rendezvous", nodes)
                    log.append({"time": now, "event": "join", "node": count, "nodes": len(alive) + 1})
                elif len(alive) > 1:
                    victim = alive[-1]
                    departed.add(victim.name)  # leaving: it may take a while to exit, it is not a member any more
                    if how == "s":
                        victim.signal(signal.SIGTERM)
                    elif how == "m":
                        (out / f"notice-{victim.name.split('-')[1]}").write_text("terminate")
                        doomed[victim.name] = now + lead_seconds
                    else:
                        victim.kill_node()
                    log.append(
                        {
                            "time": now,
                            "event": "leave",
                            "delayed": now - due,
                            "notice": how in ("s", "m"),
                            "source": {"s": "SIGTERM", "m": "metadata", "k": None}[how],
                            "node": victim.name,
                            "nodes": len(alive) - 1,
                        }
                    )
            for n in nodes:
                if n.name in doomed and now >= doomed[n.name]:
                    del doomed[n.name]
                    running = n.proc.poll() is None  # its agent still in the job (it should have left)
                    n.kill_node()  # the lead time is over: the cloud takes the machine
                    log.append(
                        {
                            "time": now,
                            "event": "reclaimed",
                            "node": n.name,
                            "nodes": log[-1]["nodes"],
                            "running": running,
                        }
                    )
            alive = [n for n in nodes if n.proc.poll() is None]
            if nodes and nodes[0].proc.poll() is not None:
                break  # the first node (the rendezvous host) finished or failed: the run is over
            if not alive and not pending:
                break
            time.sleep(0.2)
        wall = time.monotonic() - started
        ok = nodes[0].proc.returncode == 0
        if not ok:
            print(nodes[0].output()[-4000:], file=sys.stderr)
    finally:
        for n in nodes:
            n.kill()
        for server in servers.values():
            server.kill()
            server.wait(timeout=15)
    return {"events": log, "wall_seconds": wall, "ok": ok, "config": config, "epoch": epoch}


def render(result: dict[str, Any], report: dict[str, Any], title: str) -> bytes:
    """Nodes available (the replayed trace) and the training step over the replay's time, one figure."""
    from lightning_spot.observe.gantt import import_pyplot, png_bytes

    plt = import_pyplot()
    fig, ax = plt.subplots(figsize=(10, 4))
    offset = datetime.fromisoformat(report["started"]).timestamp() - result["epoch"]
    for a in report["attempts"]:
        if a["points"]:
            xs, ys = zip(*a["points"])
            ax.plot([x + offset for x in xs], ys, "-", color="#1A73E8", linewidth=1.6)
    ax.set_xlabel("seconds since the replay started")
    ax.set_ylabel("training step", color="#1A73E8")
    nodes = ax.twinx()
    times, counts = [0.0], [0]
    for e in result["events"]:
        times.append(e["time"])
        counts.append(e["nodes"])
    times.append(result["wall_seconds"])
    counts.append(counts[-1])
    nodes.step(times, counts, where="post", color="#D93025", linewidth=1.2)
    nodes.set_ylabel("nodes available (replayed)", color="#D93025")
    nodes.set_ylim(0, max(counts) + 1)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    return png_bytes(fig, 110)


def figures(out: Path, result: dict[str, Any]) -> dict[str, Any]:
    import torch

    from lightning_spot.checkpoint.durable.storage import Storage
    from lightning_spot.observe.run_report import build_report
    from tests.parity import merged_state, reference_run

    report = build_report(Storage(str(out / "run")))
    finals = sorted((out / "out" / "final").glob("rank*.pt"))
    states = [torch.load(f) for f in finals]
    config = result["config"]
    ref = reference_run(
        {"model": config["model"], "loader": config["loader"], "trainer": {"max_steps": config["max_steps"]}}
    )
    got = merged_state(states)
    worst = max((got[k] - ref["state_dict"][k]).abs().max().item() for k in ref["state_dict"])
    phases = restart_phases(report, result["events"], result["epoch"])
    return {
        "useful_time_share": report["useful_time_share"],
        **restart_goodput(report, result),
        "restarts": len(report["restarts"]),
        "steps_recomputed": report["steps_recomputed"],
        "time_lost_seconds": report["time_lost_seconds"],
        "wall_seconds": report["wall_seconds"],
        "samples_per_second_by_layout": report["samples_per_second_by_layout"],
        "phases": phases,
        "final_layout": states[-1]["layout"] if states else None,
        "max_param_difference": worst,
        "report": report,
    }


def restart_goodput(report: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """GPU-time efficiency of a restart-path replay over its history's window (the useful-time share's): the
    steps trained, at the full cluster's measured step time (its attempts on the most nodes), against the
    node-seconds the trace gave."""
    from benchmarks.goodput import figures, node_seconds, peak_nodes
    from lightning_spot.observe.cost import world_of

    log = result["events"]
    start = report["started_epoch"] - result["epoch"]
    per_world: dict[int, list[float]] = {}
    for a in report["attempts"]:
        if a["steps_per_second"]:
            per_world.setdefault(world_of(a), []).append(1.0 / a["steps_per_second"])
    by_size = {n: sum(v) / len(v) for n, v in per_world.items()}
    steps = report["attempts"][-1]["last_step"] or 0
    return figures(steps, by_size, peak_nodes(log), node_seconds(log, start, start + report["wall_seconds"]))


def restart_phases(report: dict[str, Any], events: list[dict[str, Any]], epoch: float) -> list[dict[str, Any]]:
    """Each restart of the run with the replay events behind it (those between the previous restart's new
    processes and its own) and the time from the first of them to the first step after: ``stop`` (a notice's
    coordinated stop), ``restart`` (exit, failure detection, rendezvous, new processes), ``setup``, ``restore``
    and ``first_step`` as the run's history measured them (``lightning_spot.checkpoint.durable.journal.recovery_phases``).
    Its kind: "leave (kill)" when the history saw a failure (a kill among the events), else "leave (notice)" when
    a node left, else "join". After a kill the history's ``restart`` also holds the steps taken since its last
    record, so ``after_kill`` gives the part after the (last) kill, from the replay's clock."""
    t0 = report["started_epoch"]
    out = []
    first = report["attempts"][0].get("layout_detail") or {}
    world = first.get("world_size") or first.get("pipeline_stages", 1) * first.get("data_parallel", 1)
    start = next((i + 1 for i, e in enumerate(events) if e["nodes"] == world), 0)  # the nodes of the first attempt
    later = events[start:]
    since = -float("inf")
    for r, attempt in zip(report["restarts"], report["attempts"][1:]):
        began = t0 + (attempt["process_started"] if attempt["process_started"] is not None else attempt["started"])
        behind = [e for e in later if since < epoch + e["time"] <= began]
        since = began
        kills = [e for e in behind if e["event"] == "reclaimed" or (e["event"] == "leave" and not e["notice"])]
        if r["cause"].startswith("failure"):
            kind = "leave (kill)"
        elif any(e["event"] == "leave" for e in behind):
            kind = "leave (notice)"
        else:
            kind = "join" if behind else "?"
        stepped = t0 + attempt["started"] + (attempt["first_step_after_seconds"] or 0.0)
        out.append(
            {
                "cause": r["cause"],
                "event": kind,
                "events": [_label(e) for e in behind],
                "event_to_first_step": stepped - (epoch + behind[0]["time"]) if behind else None,
                "after_kill": began - (epoch + kills[-1]["time"]) if kills and kind == "leave (kill)" else None,
                "phases": r.get("phases", {}),
                "time_lost": r["time_lost_seconds"],
                "from": r.get("resumed_from"),
                "recomputed": r["steps_recomputed"],
            }
        )
    return out


def _label(event: dict[str, Any]) -> str:
    """``join``, ``leave (notice)``, ``leave (kill)`` or ``reclaimed`` (killed at the end of its notice)."""
    if event["event"] != "leave":
        return str(event["event"])
    return "leave (notice)" if event["notice"] else "leave (kill)"


def mean_phases(phases: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Mean seconds per phase and of event -> first step, by the kind of event that caused the restart."""
    from lightning_spot.checkpoint.durable.journal import RECOVERY_PHASES

    out: dict[str, dict[str, float]] = {}
    for kind in sorted({p["event"] for p in phases}):
        rows = [p for p in phases if p["event"] == kind]
        means: dict[str, float] = {"count": len(rows)}
        for name in RECOVERY_PHASES:
            known = [p["phases"][name] for p in rows if p["phases"].get(name) is not None]
            if known:
                means[name] = sum(known) / len(known)
        for name in ("after_kill", "event_to_first_step"):
            known = [p[name] for p in rows if p[name] is not None]
            if known:
                means[name] = sum(known) / len(known)
        out[kind] = means
    return out


def goodput_line(fig: dict[str, Any]) -> str:
    """The GPU-time efficiency line of a replay's printout."""
    eff = fig.get("gpu_time_efficiency")
    if eff is None:
        return (
            f"GPU-time efficiency: - (no step measured on the full cluster of {fig['peak_nodes']} nodes; "
            f"{fig['node_seconds']:.0f} node-seconds up)"
        )
    strict = fig.get("gpu_time_efficiency_strict")
    return (
        f"GPU-time efficiency {eff:.1%}: samples trained / what {fig['node_seconds']:.0f} node-seconds up would train "
        f"at the full cluster's speed ({fig['peak_nodes']} nodes, {fig['full_cluster_step_seconds'] * 1000:.0f} ms "
        f"per step); {strict:.1%} at the best per-node speed measured at any size (steps: "
        + ", ".join(f"{n} nodes {s * 1000:.0f} ms" for n, s in sorted(fig["step_seconds_by_size"].items()))
        + ")"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", help="a shipped trace (file name without .csv)")
    source.add_argument("--fixed-rate", help="NODES,EVERY_SECONDS,DURATION_SECONDS (Oobleck's setting)")
    source.add_argument("--events", help='a synthetic trace in replay seconds, e.g. "0:+3,20:-1s,40:-1k,60:+1"')
    parser.add_argument("--compress", type=float, default=600.0, help="trace seconds per replay second")
    parser.add_argument("--from-hours", type=float, default=0.0, help="where in the trace to start")
    parser.add_argument("--hours", type=float, default=2.0, help="how much of the trace to replay")
    parser.add_argument("--cap", type=int, default=4, help="most nodes at once (one process each)")
    parser.add_argument(
        "--notice",
        choices=("s", "k", "m", "alternate"),
        default="alternate",
        help="s: SIGTERM, k: kill, m: AWS metadata notice then a kill after its lead time; alternate: s, k, s, ...",
    )
    parser.add_argument("--lead", type=float, default=120.0, help="a metadata notice's lead time, trace seconds")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument(
        "--step-seconds",
        type=float,
        help="a pause per step (stretches training; default 0.25, 0 with --step-gpu-seconds)",
    )
    parser.add_argument(
        "--step-gpu-seconds",
        type=float,
        default=0.0,
        help="a step's work, shared by the processes that train it: each pauses this / their count per step (a "
        "fixed global batch; the GPU-time efficiency needs it: a cluster's per-node speed is then its size's)",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--png", type=Path, help="draw nodes available and training progress over time here")
    parser.add_argument("--keep", type=Path, help="keep the run directory here")
    parser.add_argument("--settle", action="store_true", help="each event waits for the previous one's restart")
    parser.add_argument("--keep-alive", type=int, help="rendezvous keep-alive interval, s (lightning-spot run's: 1)")
    parser.add_argument(
        "--last-call", type=int, help="s a rendezvous round waits for more nodes (lightning-spot run's: 2)"
    )
    parser.add_argument(
        "--fault-tolerance",
        action="store_true",
        help='fault_tolerance="torchft": each node is a pipeline of its own, survivors keep training (ft_replay.py)',
    )
    args = parser.parse_args(argv)
    if args.step_seconds is None:
        args.step_seconds = 0.0 if args.step_gpu_seconds else 0.25
    if args.events:
        events = parse_events(args.events)
        label = f"synthetic {args.events}"
    else:
        if args.trace:
            trace = load_trace(args.trace)
        else:
            nodes, every, duration = args.fixed_rate.split(",")
            trace = fixed_rate(int(nodes), float(every), float(duration))
        events = trace_events(
            trace,
            cap=args.cap,
            compress=args.compress,
            start=args.from_hours * 3600,
            span=args.hours * 3600,
            notice=args.notice,
        )
        label = (
            f"{trace.name}, hours {args.from_hours:g}-{args.from_hours + args.hours:g}, compressed {args.compress:g}x"
        )
    out = args.keep or Path(tempfile.mkdtemp(prefix="spot-replay-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.fault_tolerance:
        return replay_with_fault_tolerance(events, label, out, args)
    lead = args.lead / (1.0 if args.events else args.compress)
    result = replay(
        events,
        args.steps,
        args.step_seconds,
        out,
        settle=args.settle,
        keep_alive=args.keep_alive,
        last_call=args.last_call,
        lead_seconds=lead,
        step_gpu_seconds=args.step_gpu_seconds,
    )
    if not result["ok"]:
        print("the run failed (log above)", file=sys.stderr)
        return 1
    fig = figures(out, result)
    print(f"replay of {label}: {len(result['events'])} events, {result['wall_seconds']:.1f} s")
    for e in result["events"]:
        how = {
            "join": "",
            "reclaimed": " (its notice's lead time is over: killed)",
        }.get(e["event"], f" ({e.get('source') or 'SIGTERM'} notice)" if e.get("notice") else " (killed, no notice)")
        if e.get("delayed", 0) > 0.5:
            how += f", {e['delayed']:.1f}s after it was due (the group was restarting)"
        print(f"  {e['time']:6.1f}s  {e['event']}{how} -> {e['nodes']} nodes")
    print(goodput_line(fig))
    print(
        f"useful-time share {fig['useful_time_share']:.1%}; restarts {fig['restarts']}; steps recomputed "
        f"{fig['steps_recomputed']}; time lost {fig['time_lost_seconds']:.1f} s of {fig['wall_seconds']:.1f} s"
    )
    for p in fig["phases"]:
        told = ", ".join(
            f"{k.replace('_', ' ')} {v:.1f}" for k, v in p["phases"].items() if v is not None and k != "restore"
        )
        kill = f" ({p['after_kill']:.1f} s of the restart after the kill)" if p["after_kill"] is not None else ""
        restore = p["phases"].get("restore")
        print(
            f"  {p['event']} ({', '.join(p['events'])}): {p['event_to_first_step']:.1f} s from the first event to "
            f"the first step; {told} s{kill}; "
            f"restore {restore if restore is not None else '-'} s from {p['from']}; {p['recomputed']} steps recomputed"
        )
    for kind, means in mean_phases(fig["phases"]).items():
        told = ", ".join(f"{k.replace('_', ' ')} {v:.2f}" for k, v in means.items() if k != "count")
        print(f"  mean of {means['count']:.0f} x {kind}: {told} s")
    for layout, sps in fig["samples_per_second_by_layout"].items():
        print(f"  {layout:<28}{sps:8.1f} samples/s")
    print(f"final parameters vs an uninterrupted run: max difference {fig['max_param_difference']:.2e}")
    if args.png:
        title = f"{label}: useful-time share {fig['useful_time_share']:.1%}, {fig['restarts']} restarts"
        args.png.write_bytes(render(result, fig["report"], title))
    if args.json:
        args.json.write_text(json.dumps({"label": label, **result, **fig}, indent=1, default=str))
    return 0 if fig["max_param_difference"] <= 1e-5 else 2


def replay_with_fault_tolerance(
    events: list[tuple[float, int, str]], label: str, out: Path, args: argparse.Namespace
) -> int:
    from benchmarks.ft_replay import figures_ft, print_ft, replay_ft

    result = replay_ft(events, args.steps, args.step_seconds, out, step_gpu_seconds=args.step_gpu_seconds)
    if not result["ok"]:
        print("the run failed (log above)", file=sys.stderr)
        return 1
    fig = figures_ft(out, result)
    print_ft(label, result, fig)
    if args.json:
        args.json.write_text(json.dumps({"label": label, **result, **fig}, indent=1, default=str))
    return 0 if fig["max_param_difference"] <= 1e-5 else 2


if __name__ == "__main__":
    sys.exit(main())
