"""Project spot-trace replays to clusters this machine cannot run: the useful-time share of a run whose nodes
come and go as a trace says, from step times and recovery costs instead of real processes.

    python benchmarks/spot_simulator.py calibrate r1.json r2.json r3.json   # predict measured replays
    python benchmarks/spot_simulator.py oobleck         # Oobleck's 10-minute failure case, next to its figures
    python benchmarks/spot_simulator.py large           # 64 nodes x 8 GPUs, GPT 6.7B, Bamboo's traces scaled

The model (``simulate``): the run trains at the step time of its current node count (the planner's cost model
at scale: ``gpt_plans``; measured per layout in a calibration) and every change of the node count
restarts it, as torchrun does:

- a node joins, or leaves with a notice: a coordinated stop (``stop_s``: finish the step, snapshot, exit),
  then the restart (``join_restart_s`` / ``leave_restart_s``: exit -> new processes, rendezvous included),
  ``setup_s`` (imports, process groups, planning), the state read from memory (``restore_memory_s``) and the
  first step (``first_step_s``); no step is lost;
- a node is killed without notice: the steps since the newest snapshot are lost, then ``detect_s`` (kill ->
  new processes: failure detection, rendezvous, launch), setup, the state read from memory (snapshots are
  copied to a peer node, so one lost node loses none) or from storage (``restore_storage_s``: when several
  nodes are killed at once, or snapshots are off: then the steps since the newest durable checkpoint are lost);
- a change during a restart starts the restart over (its rendezvous round is redone);
- too few nodes for the model: no training until enough are back.

With ``Policy(fault_tolerant=True)`` (``fault_tolerance="torchft"``) a node that leaves or is killed while others
can go on costs them ``ft_leave_s`` (its heartbeat expiring at the lighthouse, measured by
``benchmarks/ft_recovery.py``) plus the step in flight, run again (half a step on average), and nothing else: no
restart, no step lost; a joining node starts beside the others (``join_restart_s + setup_s + restore_memory_s``
of its own, off their path) and then stalls them ``ft_join_s``. Only when too few nodes are left does the run
take the restart path. Step times follow the node count as before (the pipelines keep their depth: at scale
that may be slower than the layout a restart would choose, which this model does not charge).

With ``Policy(pipeline_nodes=d)`` (torchft, pipelines ``d`` nodes deep) a lost node breaks its pipeline: its
``d - 1`` other nodes idle (they wait for a replacement, as a torchrun of fixed ``--nnodes`` does) and the step
time is that of the nodes in whole pipelines; a node that comes back completes a broken pipeline, which then joins.
A loss hits a whole pipeline while there is one (the broken pipelines' few nodes are the less likely victims).

Useful time is time spent on steps that are kept (as ``lightning-spot report`` counts it: a kept step costs
its step time, snapshot and checkpoint stalls included); the share is useful time / wall time. **GPU-time
efficiency** (goodput against the GPUs available) is the samples trained / the samples the nodes up at each
moment would have trained at the full cluster's per-node speed: ``steps x step_seconds(peak) x peak / node-seconds``
(``peak``: the most nodes the trace gives). It charges what the useful-time share cannot see: idle nodes (a broken
pipeline's, a joiner's set-up) and a smaller cluster's slower steps.
Every input is a field of ``Recovery``, ``Policy`` or the step-time function: nothing else is assumed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.spot_traces import Trace, load_trace  # noqa: E402

#: (time in seconds, change of the node count, notice): ``notice`` None lets the policy decide; ``JOINED``: a
#: node that started beside a fault-tolerant run is ready to join it
Event = tuple[float, int, "bool | str | None"]
JOINED = "joined"
#: (fault-tolerant, ``Policy(reform_s=...)``) a broken pipeline's survivors have re-formed at a smaller depth
REFORMED = "reformed"


@dataclass(frozen=True)
class Recovery:
    """Seconds each phase of a restart takes (``journal.recovery_phases``; ``spot_replay.py`` measures them)."""

    stop_s: float  # notice -> snapshot committed and processes exiting (coordinated stop)
    join_restart_s: float  # a node joins: exit -> new processes (rendezvous, launch)
    leave_restart_s: float  # a node leaves with notice: exit -> new processes
    detect_s: float  # a node is killed: kill -> new processes (failure detection, rendezvous, launch)
    setup_s: float  # process start -> training starts, less the state read
    restore_memory_s: float
    restore_storage_s: float
    first_step_s: float  # training starts -> first step done
    #: fault_tolerance="torchft" (benchmarks/ft_recovery.py, 2-core CPU): a pipeline lost -> the others' next
    #: committed step, less the step itself; a joiner's stall of the others
    ft_leave_s: float = 1.07
    ft_join_s: float = 0.05


@dataclass(frozen=True)
class Policy:
    """What the run does: snapshot and checkpoint intervals, which leaves come with notice."""

    snapshot_every: int = 1  # steps; 0: no in-memory snapshots
    checkpoint_every: int = 20  # steps between durable checkpoints
    notice: str = "alternate"  # leaves without a stated notice: "all", "none" or "alternate" (first one has one)
    #: nodes killed at once that the in-memory snapshots survive (peer copies: 1; every node holding whole
    #: pipelines: all but one)
    memory_survives_kills: int = 1
    snapshot_stall_s: float = 0.0  # training time blocked per snapshot
    checkpoint_stall_s: float = 0.0  # per durable checkpoint
    fault_tolerant: bool = False  # survivors keep training (see the module's docstring)
    #: fault-tolerant: nodes per pipeline (a lost node idles the other nodes of its pipeline)
    pipeline_nodes: int = 1
    #: fault-tolerant: seconds after which a broken pipeline's survivors train again, re-formed at a smaller depth
    #: (issue 62's re-form; None: they wait for a node to come back); a node that comes back trains after its start-up
    reform_s: float | None = None


@dataclass
class Outcome:
    """One simulated run."""

    wall_s: float = 0.0
    useful_s: float = 0.0
    steps: float = 0.0
    steps_lost: float = 0.0
    restarts: int = 0
    from_storage: int = 0
    quorum_changes: int = 0  # fault-tolerant: membership changes the survivors rode through
    down_s: float = 0.0  # restarting (every phase)
    idle_s: float = 0.0  # too few nodes for the model
    per_nodes: dict[int, float] = field(default_factory=dict)  # training seconds by node count
    node_s: float = 0.0  # nodes up x seconds, over the wall time
    peak_nodes: int = 0  # the most nodes up at once (the full cluster)
    peak_step_s: float = 0.0  # seconds per step on the full cluster
    idle_node_s: float = 0.0  # fault-tolerant: node-seconds of broken pipelines' nodes, waiting

    @property
    def share(self) -> float:
        return self.useful_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def gpu_time_efficiency(self) -> float:
        """Samples trained / samples the nodes up would have trained at the full cluster's per-node speed."""
        available = self.node_s / (self.peak_step_s * self.peak_nodes) if self.peak_step_s > 0 else 0.0
        return self.steps / available if available > 0 else 0.0

    @property
    def share_while_enough(self) -> float:
        """The share over the time when enough nodes were up to train at all (the trace's own gaps left out)."""
        span = self.wall_s - self.idle_s
        return self.useful_s / span if span > 0 else 0.0


def simulate(
    events: Sequence[Event],
    step_seconds: Callable[[int], float | None],
    recovery: Recovery,
    policy: Policy = Policy(),
    *,
    until_s: float | None = None,
    steps: int | None = None,
) -> Outcome:
    """Replay ``events`` (time-ordered; the run starts training at time 0 with the nodes joined at time 0) until
    ``until_s`` or until ``steps`` steps are done, whichever comes first."""
    assert until_s is not None or steps is not None, "say when the run ends"
    out = Outcome()
    nodes = 0
    clock = 0.0
    ready = 0.0  # training (re)starts at this time; math.inf: too few nodes
    progress = 0.0  # steps done, kept so far
    segments: list[list[float]] = []  # [steps, seconds per step] of each training stretch, in order
    leaves = 0
    pending = sorted(events, key=lambda e: e[0])
    while pending and pending[0][0] <= 0:
        nodes += pending.pop(0)[1]
    ready = 0.0 if step_seconds(nodes) is not None else math.inf
    horizon = until_s if until_s is not None else math.inf
    depth = max(1, policy.pipeline_nodes) if policy.fault_tolerant else 1
    reform = policy.reform_s is not None and depth > 1  # (nodes left over form a shallower pipeline)
    spare = 0 if reform else nodes % depth  # nodes of broken pipelines (fault-tolerant, pipelines ``depth`` deep)
    out.peak_nodes = _peak(events)
    out.peak_step_s = step_seconds(out.peak_nodes) or 0.0
    counted = 0.0  # the node-seconds are counted up to this time
    joining = 0  # fault-tolerant: nodes up that are still starting beside the run

    def per_step(n: int) -> float | None:
        s = step_seconds(n)
        if s is None:
            return None
        stall = (policy.snapshot_stall_s / policy.snapshot_every) if policy.snapshot_every else 0.0
        return s + stall + policy.checkpoint_stall_s / policy.checkpoint_every

    def count_nodes(until: float) -> None:
        """Add the nodes up (and the broken pipelines' idle ones) from the last count to ``until``."""
        nonlocal counted
        if until > counted:
            out.node_s += (nodes + joining) * (until - counted)
            out.idle_node_s += (spare + joining) * (until - counted)
            counted = until

    def train(until: float) -> float:
        """Advance the clock to ``until`` (training where possible); the time the run ended, if it did."""
        nonlocal clock, progress, snapshots
        begin = max(clock, ready)
        s = per_step(nodes - spare)
        if ready > clock:
            gap = min(until, ready) - clock
            if math.isinf(ready):
                out.idle_s += max(0.0, gap)
            else:
                out.down_s += max(0.0, gap)
        if s is not None and until > begin:
            snapshots = True  # training again: new snapshots are taken
            todo = (steps - progress) if steps is not None else math.inf
            done = min((until - begin) / s, todo)
            progress += done
            segments.append([done, s])
            out.per_nodes[nodes - spare] = out.per_nodes.get(nodes - spare, 0.0) + done * s
            if steps is not None and progress >= steps - 1e-9:
                clock = begin + done * s
                count_nodes(clock)
                return clock
        count_nodes(until)
        clock = until
        return math.inf

    def lose(back_to: float) -> None:
        """Drop the steps after ``back_to`` (a kill: they are recomputed)."""
        nonlocal progress
        lost = progress - back_to
        out.steps_lost += lost
        progress = back_to
        while lost > 1e-12 and segments:
            take = min(lost, segments[-1][0])
            segments[-1][0] -= take
            lost -= take
            if segments[-1][0] <= 1e-12:
                segments.pop()

    def restart(at: float, before: float, tier: str) -> None:
        """Restart at ``at`` after ``before`` seconds of stop/detection, reading the state from ``tier``."""
        nonlocal ready
        if clock >= ready:  # a change during a restart redoes that restart: not one more
            out.restarts += 1
            out.from_storage += tier == "storage"
        if step_seconds(nodes - spare) is None:
            ready = math.inf
            return
        read = recovery.restore_memory_s if tier == "memory" else recovery.restore_storage_s
        ready = at + before + recovery.setup_s + read + recovery.first_step_s

    snapshots = True  # the newest snapshot is still in some node's memory

    def tier() -> str:
        return "memory" if policy.snapshot_every and snapshots else "storage"

    ended = math.inf
    while pending and ended == math.inf:
        at, change, notice = pending.pop(0)
        if at >= horizon:
            pending.insert(0, (at, change, notice))
            break
        ended = train(at)
        if ended != math.inf:
            break
        training = clock >= ready
        if notice == REFORMED:  # survivors of broken pipelines train again at a smaller depth
            if spare:
                spare = max(0, spare - change)
                out.quorum_changes += 1
                ready = max(ready, at + recovery.ft_join_s)
            continue
        # survivors can go on: the nodes left in whole pipelines hold the model (or re-formed ones will)
        broken = _broken_after(nodes, spare, change, depth) if change < 0 else spare
        left = nodes + change - (0 if reform else broken)
        rides_through = change > 0 or step_seconds(left) is not None
        if policy.fault_tolerant and training and rides_through:
            if change > 0 and notice != JOINED:  # the new node starts beside the run and joins when it is ready
                ready_at = at + recovery.join_restart_s + recovery.setup_s + recovery.restore_memory_s
                pending = sorted([*pending, (ready_at, change, JOINED)], key=lambda e: e[0])
                joining += change
                continue
            if notice == JOINED:
                joining -= change
            whole_before = nodes - spare
            nodes += change
            if change < 0 and reform and broken > spare:  # the newly broken pipelines' survivors re-form
                assert policy.reform_s is not None
                pending = sorted([*pending, (at + policy.reform_s, broken - spare, REFORMED)], key=lambda e: e[0])
            spare = broken if change < 0 else (spare if reform else (spare + change) % depth)
            if nodes - spare < 1 or step_seconds(nodes - spare) is None:  # nothing whole trains until they re-form
                ready = math.inf if not reform else max(ready, at + (policy.reform_s or 0.0))
                continue
            if nodes - spare != whole_before:  # the quorum changes (a node that completes no pipeline idles)
                out.quorum_changes += 1
                stall = recovery.ft_join_s if change > 0 else recovery.ft_leave_s + (per_step(whole_before) or 0.0) / 2
                ready = at + stall
            continue
        if notice == JOINED:  # (a joiner ready while the others restart: it joins their restart)
            joining -= change
        nodes += change
        spare = 0 if reform else nodes % depth  # (restarted: whole pipelines re-form; a broken one's torchrun waits)
        if change > 0:
            cost = (recovery.stop_s if training else 0.0) + recovery.join_restart_s
            restart(at, cost, tier())
            continue
        kinds = []
        for _ in range(-change):
            kinds.append(notice if notice is not None else _policy_notice(policy.notice, leaves))
            leaves += 1
        killed = kinds.count(False)
        if killed and (killed > policy.memory_survives_kills or nodes == 0):
            snapshots = False  # every copy of some state was on the nodes killed
        if killed:
            if training:
                keep = policy.snapshot_every if tier() == "memory" else policy.checkpoint_every
                lose(math.floor(progress / keep + 1e-9) * keep)
            restart(at, recovery.detect_s, tier())
        else:
            snapshots = snapshots and nodes > 0  # a coordinated stop leaves a durable checkpoint behind too
            restart(at, (recovery.stop_s if training else 0.0) + recovery.leave_restart_s, tier())
    if ended == math.inf:
        ended = train(horizon) if not math.isinf(horizon) else train(clock + 10**9)
    out.wall_s = ended if ended != math.inf else horizon
    out.steps = progress
    out.useful_s = sum(n * s for n, s in segments)
    return out


def _peak(events: Sequence[Event]) -> int:
    """The most nodes up at once (events in time order; joiners of a fault-tolerant run count once)."""
    up = peak = 0
    for _, change, notice in sorted(events, key=lambda e: e[0]):
        if notice != JOINED:
            up += change
            peak = max(peak, up)
    return peak


def _broken_after(nodes: int, spare: int, change: int, depth: int) -> int:
    """Nodes of broken pipelines after ``-change`` nodes are lost: each loss breaks a whole pipeline while there
    is one (its other ``depth - 1`` nodes idle), else takes an idle node."""
    for _ in range(-change):
        if nodes - spare >= depth and depth > 1:
            spare += depth - 1
        else:
            spare = max(0, spare - 1)
        nodes -= 1
    return spare


def _policy_notice(policy: str, index: int) -> bool:
    return policy == "all" or (policy == "alternate" and index % 2 == 0)


def trace_events(
    trace: Trace, *, scale: float = 1.0, cap: int | None = None, start: float = 0.0, span: float = math.inf
) -> list[Event]:
    """A trace window as events from time 0 (the nodes up at ``start`` join at 0), counts x ``scale``."""

    def count(n: int) -> int:
        c = round(n * scale)
        return min(c, cap) if cap is not None else c

    events: list[Event] = [(0.0, count(trace.at(start)), None)]
    current = events[0][1]
    for t, n in zip(trace.times, trace.counts):
        if start < t <= start + span and count(n) != current:
            events.append((t - start, count(n) - current, None))
            current = count(n)
    return events


# ------------------------------------------------------------------------------------------------ calibration
def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def recovery_from_replays(replays: Sequence[dict[str, Any]], fallback: Recovery | None = None) -> Recovery:
    """The mean measured phases of ``spot_replay.py --json`` results, by the kind of event behind each restart;
    ``fallback`` gives what they did not measure (e.g. a read from storage when every resume read memory)."""
    rows = [p for r in replays for p in r["phases"]]
    every = ("join", "leave (notice)", "leave (kill)")

    def mean(field_name: str, kinds: tuple[str, ...], phase: str | None = None, key: str | None = None) -> float:
        values = []
        for row in rows:
            value = row[key] if key else row["phases"].get(phase)
            if row["event"] in kinds and value is not None:
                values.append(value)
        found = _mean(values)
        if found is not None:
            return found
        if fallback is None:
            raise ValueError(f"the replays measured no {key or phase} after a {' or '.join(kinds)}: give a fallback")
        return float(getattr(fallback, field_name))

    memory = mean("restore_memory_s", every, "restore")
    return Recovery(
        stop_s=mean("stop_s", ("join", "leave (notice)"), "stop"),
        join_restart_s=mean("join_restart_s", ("join",), "restart"),
        leave_restart_s=mean("leave_restart_s", ("leave (notice)",), "restart"),
        detect_s=mean("detect_s", ("leave (kill)",), key="after_kill"),
        setup_s=mean("setup_s", every, "setup"),
        restore_memory_s=memory,
        restore_storage_s=fallback.restore_storage_s if fallback else memory,
        first_step_s=mean("first_step_s", every, "first_step"),
    )


def replay_inputs(replay: dict[str, Any]) -> tuple[list[Event], dict[int, float], int]:
    """What a measured replay gives the simulator: its events on the run history's clock (0 = training
    started; the nodes of the first attempt join at 0, a later event that came before training started
    restarts it right away), the measured seconds per step by process count, and the steps it trained."""
    report = replay["report"]
    offset = replay["epoch"] - report["started_epoch"]
    worlds = []
    per_world: dict[int, list[float]] = {}
    for a in report["attempts"]:
        detail = a.get("layout_detail") or {}
        world = int(detail.get("world_size") or detail["pipeline_stages"] * detail["data_parallel"])
        worlds.append(world)
        if a.get("steps_per_second"):
            per_world.setdefault(world, []).append(1.0 / a["steps_per_second"])
    log = replay["events"]
    start = next((i + 1 for i, e in enumerate(log) if e.get("nodes") == worlds[0]), 0)
    events: list[Event] = [(0.0, 1, None)] * start
    for e in log[start:]:
        if e["event"] == "reclaimed":
            continue  # the node left at its notice; the simulator assumes its stop ends within the lead time
        change = 1 if e["event"] == "join" else -1
        events.append((max(e["time"] + offset, 1e-6), change, None if change > 0 else bool(e["notice"])))
    seconds = {w: sum(v) / len(v) for w, v in per_world.items()}
    return events, seconds, int(report["attempts"][-1]["last_step"])


def nearest(table: dict[int, float]) -> Callable[[int], float | None]:
    """Seconds per step at ``n`` processes: measured, else the nearest measured count's (none at 0)."""
    return lambda n: None if n < 1 else table[min(table, key=lambda k: (abs(k - n), k))]


def calibrate(replays: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Predict each replay's useful-time share from the others' recovery phases (leave one out) and its own
    step times and events; next to what was measured."""
    rows = []
    pooled = recovery_from_replays(replays)
    for i, replay in enumerate(replays):
        others = [r for j, r in enumerate(replays) if j != i] or [replay]
        recovery = recovery_from_replays(others, fallback=pooled)  # a phase the others never saw: everyone's
        events, seconds, steps = replay_inputs(replay)
        config = replay["config"]
        policy = Policy(snapshot_every=config.get("snapshot_every") or 0, checkpoint_every=config["every"])
        predicted = simulate(events, nearest(seconds), recovery, policy, steps=steps)
        measured = replay["report"]
        rows.append(
            {
                "replay": replay.get("label", f"replay {i}"),
                "measured_share": measured["useful_time_share"],
                "predicted_share": predicted.share,
                "measured_wall_s": measured["wall_seconds"],
                "predicted_wall_s": predicted.wall_s,
                "measured_restarts": len(measured["restarts"]),
                "predicted_restarts": predicted.restarts,
                "recovery": asdict(recovery),
            }
        )
    return rows


# --------------------------------------------------------------------------------------------- at scale
@dataclass(frozen=True)
class GPT:
    """A GPT's size and the device it runs on, for a profile built from FLOPs instead of measured."""

    layers: int = 32  # GPT-3 6.7B (Brown et al. 2020, table 2.1)
    hidden: int = 4096
    sequence: int = 2048
    vocab: int = 50257
    device_flops: float = 312e12 * 0.45  # A100 bf16 peak x the model-FLOPs utilisation assumed (45%)
    device_memory: float = 40e9  # A100 40 GB
    network_bytes_per_s: float = 400e9 / 8 / 8  # p4d: 400 Gb/s EFA per node, shared by its 8 GPUs
    host_copy_bytes_per_s: float = 25e9  # PCIe gen4 x16
    bytes_per_param: int = 2  # bf16 weights; fp32 masters and Adam moments: 16 bytes of state per parameter

    @property
    def params(self) -> float:
        return self.layers * 12 * self.hidden**2 + self.vocab * self.hidden

    def state_bytes(self) -> float:
        """Weights, gradients, fp32 masters and Adam moments (16 bytes per parameter)."""
        return 16 * self.params


def gpt_profile(model: GPT) -> Any:
    """A planner profile of one sequence per micro-batch: each layer's time from its FLOPs at the assumed
    utilisation (backward = 2 x forward), saved activations 34 x sequence x hidden bytes (bf16, flash attention:
    Korthikanti et al. 2022), the LM head and loss as the last module."""
    from lightning_spot.planning.profile import LayerProfile, ModelProfile

    s, h = model.sequence, model.hidden
    forward = (2 * 12 * h * h * s + 4 * s * s * h) / model.device_flops
    layer = LayerProfile(forward, 2 * forward, 12 * h * h * model.bytes_per_param, 34 * s * h, s * h * 2)
    head = 2 * model.vocab * h * s / model.device_flops
    embed_bytes = model.vocab * h * model.bytes_per_param
    return ModelProfile(
        samples=1,
        device="simulated",
        layers=[layer] * model.layers,
        first=LayerProfile(1e-4, 2e-4, embed_bytes, 0, s * h * 2),
        last=LayerProfile(head, 2 * head, embed_bytes, s * model.vocab * 4, 4),
    )


def gpt_hardware(model: GPT) -> Any:
    from lightning_spot.planning.hardware import Hardware

    return Hardware(
        memory_bytes=model.device_memory * 0.9,  # what the allocator leaves
        p2p_bytes_per_s=model.network_bytes_per_s,
        allreduce_bytes_per_s=model.network_bytes_per_s,
        optimizer_bytes_per_s=1e12,
        state_factor=8.0,  # 16 bytes of state per 2 bytes of parameters
        microbatch_overhead_s=1e-3,
        step_overhead_s=0.05,
    )


def gpt_plans(model: GPT, *, gpus_per_node: int, global_batch: int) -> Callable[[int], Any]:
    """The planner's best layout on ``n`` nodes: its best uniform layout for ``n x gpus_per_node`` devices
    (``plan_layouts``), else its best layout of mixed depths (``plan_mixed``, 1F1B: seconds per node count
    instead of minutes), as ``pipeline_stages="auto"`` would; None when nothing fits. Mixes that would beat a
    uniform layout that fits are not looked for (the planner takes those when 3% faster): slightly pessimistic."""
    from lightning_spot.planning.cost_model import LayoutError, plan_layouts
    from lightning_spot.planning.mixed import plan_mixed

    profile, hardware = gpt_profile(model), gpt_hardware(model)

    @cache
    def plan(n: int) -> Any:
        world = n * gpus_per_node
        if world < 1:
            return None
        try:
            return plan_layouts(profile, world_size=world, global_batch=global_batch, hardware=hardware)[0]
        except LayoutError:
            mixed = plan_mixed(
                profile, world_size=world, global_batch=global_batch, hardware=hardware, schedules=("1F1B",)
            )
            return mixed[0] if mixed else None

    return plan


def step_seconds_of(plan: Callable[[int], Any]) -> Callable[[int], float | None]:
    """Seconds per step on ``n`` nodes from a layout per node count (``gpt_plans``), None when nothing fits."""

    def seconds(n: int) -> float | None:
        best = plan(n)
        return None if best is None else float(best.predicted_step_seconds)

    return seconds


@dataclass(frozen=True)
class AtScale:
    """How a restart measured on this machine's CPUs grows on a GPU cluster (assumptions, stated)."""

    #: CUDA contexts and NCCL communicators of hundreds of ranks, the first step's warm-up: added to set-up
    extra_setup_s: float = 15.0
    #: host memory -> device (PCIe gen4 x16) and, when the layout changes, every byte of a node's state over its
    #: network once (p4d: 400 Gb/s)
    host_copy_bytes_per_s: float = 25e9
    node_network_bytes_per_s: float = 50e9
    #: object storage -> one node (many parallel S3 streams; an assumption, measure yours)
    storage_bytes_per_node_s: float = 2e9


def scaled_recovery(
    measured: Recovery, *, state_per_gpu: float, gpus_per_node: int, step_s: float, at: AtScale
) -> Recovery:
    """The measured CPU phases where they are launcher timing (rendezvous, failure detection: torchrun's
    settings, not the cluster's size); set-up grown by ``at.extra_setup_s``; the state's moves from its bytes."""
    per_node = state_per_gpu * gpus_per_node
    copy = state_per_gpu / at.host_copy_bytes_per_s
    return Recovery(
        stop_s=step_s / 2 + copy,  # finish the step on average half done, then copy the snapshot out
        join_restart_s=measured.join_restart_s,
        leave_restart_s=measured.leave_restart_s,
        detect_s=measured.detect_s,
        setup_s=measured.setup_s + at.extra_setup_s,
        restore_memory_s=copy + per_node / at.node_network_bytes_per_s,
        restore_storage_s=per_node / at.storage_bytes_per_node_s + copy,
        first_step_s=measured.first_step_s,
    )


#: Oobleck's simulator (SymbioticLab/Oobleck, branch sosp23-artifact, tools/simulator, README "Figure 1+12"):
#: useful ("effective") time share with one node lost every 10 minutes (traces/10m.csv: 30 nodes, one removed
#: every 601.2 s until 15 remain, 2.5 h), BERT-large, global batch 8192
OOBLECK_PUBLISHED = {"Oobleck": 0.955, "Varuna": 0.544, "Bamboo": 0.150}
#: the same simulator's BERT-large throughput (samples/s) at 30 and 15 nodes (one GPU each), used for our steps
#: too: the comparison is about recovery, not kernels
OOBLECK_BERT_SAMPLES_PER_S = (30, 368.2, 15, 192.3)
BERT_LARGE_PARAMS = 340e6


def oobleck_case(
    measured: Recovery, at: AtScale = AtScale(), pipeline_nodes: int = 1, reform_s: float | None = None
) -> dict[str, Any]:
    """Our useful-time share and GPU-time efficiency in Oobleck's 10-minute failure case (every failure a kill
    without notice); ``pipeline_nodes``: torchft's pipelines span that many nodes (a lost node idles the others of
    its pipeline; the restart path re-plans on every node left); ``reform_s``: their survivors re-form after it."""
    hi, hi_sps, lo, lo_sps = OOBLECK_BERT_SAMPLES_PER_S
    batch = 8192

    def step_seconds(n: int) -> float | None:
        if n < 1:
            return None
        if n < lo:
            return batch / (lo_sps * n / lo)
        return batch / (lo_sps + (hi_sps - lo_sps) * (min(n, hi) - lo) / (hi - lo))

    duration, every = 2.5 * 3600, 601.2
    events: list[Event] = [(0.0, hi, None)]
    events += [(k * every, -1, False) for k in range(1, hi - lo + 1) if k * every < duration]
    state_per_gpu = 16 * BERT_LARGE_PARAMS  # one GPU per node: whole replicas (data parallel)
    recovery = scaled_recovery(
        measured, state_per_gpu=state_per_gpu, gpus_per_node=1, step_s=step_seconds(hi) or 0.0, at=at
    )
    copy = state_per_gpu / at.host_copy_bytes_per_s
    policy = Policy(
        snapshot_every=1, checkpoint_every=20, notice="none", memory_survives_kills=hi - 1, snapshot_stall_s=copy
    )
    out = simulate(events, step_seconds, recovery, policy, until_s=duration)
    ft_policy = Policy(
        snapshot_every=0,
        checkpoint_every=20,
        notice="none",
        fault_tolerant=True,
        pipeline_nodes=pipeline_nodes,
        reform_s=reform_s,
    )
    ft = simulate(events, step_seconds, recovery, ft_policy, until_s=duration)
    return {
        "setting": "Oobleck's 10-minute case: BERT-large, 30 -> 15 nodes, one killed every 601.2 s, 2.5 h"
        + (f"; torchft's pipelines {pipeline_nodes} nodes deep" if pipeline_nodes > 1 else "")
        + (f", re-formed on their survivors after {reform_s:g} s (assumed)" if reform_s is not None else ""),
        "share": out.share,
        "share_torchft": ft.share,
        "gpu_time_efficiency": out.gpu_time_efficiency,
        "gpu_time_efficiency_torchft": ft.gpu_time_efficiency,
        "outcome_torchft": asdict(ft),
        "outcome": asdict(out),
        "recovery": asdict(recovery),
        "policy": asdict(policy),
        "published": OOBLECK_PUBLISHED,
    }


def large_case(
    trace: Trace,
    measured: Recovery,
    *,
    nodes: int = 64,
    gpus_per_node: int = 8,
    global_batch: int = 1024,
    model: GPT = GPT(),
    at: AtScale = AtScale(),
    snapshot_every: int = 10,
    checkpoint_every: int = 50,
) -> dict[str, Any]:
    """A GPT on ``nodes x gpus_per_node`` GPUs through ``trace`` scaled to ``nodes`` at its peak: the useful-time
    share with in-memory snapshots (durable checkpoints behind them) and with object storage only."""
    plan = gpt_plans(model, gpus_per_node=gpus_per_node, global_batch=global_batch)
    seconds = step_seconds_of(plan)
    events = trace_events(trace, scale=nodes / max(trace.counts))
    best = plan(nodes)
    if best is None:
        raise ValueError(f"the model fits on no layout of {nodes} x {gpus_per_node} devices: use more nodes")
    full = float(best.predicted_step_seconds)
    stages = getattr(best, "pipeline_stages", None) or min(best.depths)  # uniform, or the shallowest pipeline
    state_per_gpu = model.state_bytes() / stages
    recovery = scaled_recovery(measured, state_per_gpu=state_per_gpu, gpus_per_node=gpus_per_node, step_s=full, at=at)
    copy = state_per_gpu / at.host_copy_bytes_per_s
    whole = stages <= gpus_per_node  # every node holds whole pipelines: any survivor has every stage
    paths = {
        "memory": Policy(
            snapshot_every=snapshot_every,
            checkpoint_every=checkpoint_every,
            memory_survives_kills=nodes - 1 if whole else 1,
            snapshot_stall_s=copy,
        ),
        "storage": Policy(snapshot_every=0, checkpoint_every=checkpoint_every, checkpoint_stall_s=copy),
        "torchft": Policy(
            snapshot_every=0,
            checkpoint_every=checkpoint_every,
            checkpoint_stall_s=copy,
            fault_tolerant=True,
            pipeline_nodes=-(-stages // gpus_per_node),  # a pipeline deeper than a node spans several
        ),
    }
    results = {
        name: simulate(events, seconds, recovery, policy, until_s=trace.duration) for name, policy in paths.items()
    }
    return {
        "setting": f"GPT {model.params / 1e9:.1f}B, {nodes} x {gpus_per_node} GPUs at the trace's peak, global batch "
        f"{global_batch}, trace {trace.name} scaled x{nodes / max(trace.counts):.2f}, {trace.duration / 3600:.1f} h",
        "layout_at_peak": best.describe(),
        "step_seconds_at_peak": full,
        "state_per_gpu_bytes": state_per_gpu,
        "recovery": asdict(recovery),
        "paths": {
            name: {
                "share": out.share,
                "share_while_enough": out.share_while_enough,
                "gpu_time_efficiency": out.gpu_time_efficiency,
                "outcome": asdict(out),
                "policy": asdict(paths[name]),
            }
            for name, out in results.items()
        },
    }


# ------------------------------------------------------------------------------------------------------ CLI
def _load(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """Replays as ``spot_replay.py --json`` wrote them, each restart's phases read again from its history and
    event log (the current rules for which event caused it)."""
    from benchmarks.spot_replay import restart_phases

    replays = [json.loads(Path(p).read_text()) for p in paths]
    for r in replays:
        r["phases"] = restart_phases(r["report"], r["events"], r["epoch"])
    return replays


def _print_recovery(recovery: Recovery) -> None:
    print("  recovery (s): " + ", ".join(f"{k.removesuffix('_s')} {v:.2f}" for k, v in asdict(recovery).items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case", choices=("calibrate", "oobleck", "large"))
    parser.add_argument(
        "replays",
        nargs="*",
        type=Path,
        help="spot_replay.py --json results (measured phases; the restart path needs them)",
    )
    parser.add_argument("--trace", action="append", help="large: shipped traces (default: Bamboo's two g4dn traces)")
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument(
        "--pipeline-nodes", type=int, default=1, help="oobleck: torchft's pipelines span this many nodes"
    )
    parser.add_argument(
        "--reform-seconds", type=float, help="oobleck: a broken pipeline's survivors re-form after this (assumed)"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    replays = _load(args.replays)
    result: Any
    if args.case == "calibrate":
        result = calibrate(replays)
        print("replay                                              measured  predicted  wall (s) meas./pred.  restarts")
        for row in result:
            print(
                f"  {row['replay'][:50]:<50}{row['measured_share']:8.1%}  {row['predicted_share']:9.1%}  "
                f"{row['measured_wall_s']:7.0f} / {row['predicted_wall_s']:<7.0f}  {row['measured_restarts']} / "
                f"{row['predicted_restarts']}"
            )
    else:
        unmeasured = Recovery(*[math.nan] * 8)  # a phase no replay measured stays "nan": visible if it is used
        measured = recovery_from_replays(replays, fallback=unmeasured)
        print("measured on this machine (mean of the replays' restarts; nan: not measured):")
        _print_recovery(measured)
        if args.case == "oobleck":
            result = oobleck_case(measured, pipeline_nodes=args.pipeline_nodes, reform_s=args.reform_seconds)
            print(result["setting"])
            _print_recovery(Recovery(**result["recovery"]))
            restart_path = f"{result['share']:.1%}" if not math.isnan(measured.detect_s) else "(needs replays)"
            restart_eff = (
                f"{result['gpu_time_efficiency']:.1%}" if not math.isnan(measured.detect_s) else "(needs replays)"
            )
            print(
                f"  lightning-spot, restart path (simulated): {restart_path} useful time, {restart_eff} GPU-time "
                f"efficiency"
            )
            print(
                f"  lightning-spot, fault_tolerance='torchft' (simulated): {result['share_torchft']:.1%} useful time, "
                f"{result['gpu_time_efficiency_torchft']:.1%} GPU-time efficiency"
            )
            for name, share in result["published"].items():
                print(f"  {name} (published, Oobleck's simulator): {share:.1%}")
        else:
            names = args.trace or [
                "aws-spot-instances-g4dn-xlarge-us-east-1c-2020-11-20-1930-to-2020-11-21-2200",
                "aws-spot-instances-g4dn-xlarge-us-east-1d-2020-11-23-1730-to-2020-11-24-1530",
            ]
            result = []
            for name in names:
                row = large_case(load_trace(name), measured, nodes=args.nodes, gpus_per_node=args.gpus_per_node)
                result.append(row)
                print(row["setting"])
                print(f"  at the peak: {row['layout_at_peak']}")
                _print_recovery(Recovery(**row["recovery"]))
                for path, r in row["paths"].items():
                    o = r["outcome"]
                    print(
                        f"  {path:<8} useful time {r['share']:.1%} ({r['share_while_enough']:.1%} of the time with "
                        f"enough nodes), GPU-time efficiency {r['gpu_time_efficiency']:.1%}: "
                        f"{o['restarts']} restarts ({o['from_storage']} read "
                        f"storage), {o['steps_lost']:.0f} steps lost, {o['down_s'] / 3600:.2f} h restarting, "
                        f"{o['idle_s'] / 3600:.2f} h too few nodes"
                    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
