"""A seeded chaos soak of torchft pipelines on a coordinator, for the slow test and ``benchmarks/chaos_soak.py``.

    soak = ChaosSoak(tmp_path, seed=3, pipelines=3, events=8)
    report = soak.run()        # per event: what it hit, the untouched pipelines' longest pause; start-overs; hangs
    report.failures()          # what broke the soak's promises ([] when none)

Pipelines of two one-process nodes each (an agent per node, ``--nnodes 1:2``, each pipeline its own rendezvous on the
coordinator's store, ``fault_tolerance="torchft"`` with the coordinator's lighthouse) train the tiny model with SGD.
A seeded sequence of events hits them: a node killed (SIGKILL of its agent and workers), a notice (SIGTERM to its
agent: its workers leave with exit 75 and it ends), a node that was down started again, and the coordinator killed
and started again on its ports within 0.5-3 s. Never every pipeline at once: at least one stays whole. Every worker
appends each step's end to a log (``--step-log``), which is the run's step history: after each event the soak
measures how long each pipeline the event did not touch went without a step, and at the end whether any process
started behind the steps the live pipelines held (a start-over), whether any pipeline stopped stepping (a hang), and
whether each pipeline ends equal to one process.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.distributed import free_port
from tests.elastic import RDZV_CONF, Agent, descendants, port_open

WORKER = "tests/workers/ft_train.py"
#: node events' goal for the pipelines they did not touch, and a coordinator restart's for every pipeline (issue 71)
NODE_PAUSE_GOAL_S = 2.0
COORDINATOR_PAUSE_GOAL_S = 5.0
#: a process that starts this many steps behind the live pipelines' newest started over
START_OVER_STEPS = 3
#: a pipeline with a live node that has not stepped for this long hangs
HANG_S = 60.0


@dataclass
class Event:
    """One event of the soak: its kind, the node or pipeline it hit, when, and what it cost the others."""

    kind: str  # kill | notice | return | coordinator
    node: str  # "1b" (pipeline 1's node b), or "" for the coordinator
    at: float
    #: the longest time each pipeline the event did not touch went without a step, from the event to the next one
    pauses: dict[str, float] = field(default_factory=dict)
    #: pipelines the event did not touch whose processes restarted meanwhile
    restarted: list[str] = field(default_factory=list)
    #: seconds from the event to its end (a coordinator restart: until its ports were open again)
    downtime: float = 0.0

    @property
    def goal(self) -> float:
        """A coordinator restart's goal; a node event's, per pipeline it restarts (nodes of several pipelines back at
        once restart each: every one that leaves costs the others up to a lighthouse heartbeat timeout, 1 s)."""
        if self.kind == "coordinator":
            return COORDINATOR_PAUSE_GOAL_S
        return NODE_PAUSE_GOAL_S * max(1, len({n[:-1] for n in self.node.split("+") if n}))

    def longest(self) -> float:
        return max(self.pauses.values(), default=0.0)


@dataclass
class SoakReport:
    seed: int
    events: list[Event]
    start_overs: list[str]
    hangs: list[str]
    weights: dict[str, float]
    steps: dict[str, int]
    codes: dict[str, int | None]
    seconds: float

    def failures(self) -> list[str]:
        found = [f"start-over: {s}" for s in self.start_overs] + [f"hang: {h}" for h in self.hangs]
        for e in self.events:
            if e.longest() > e.goal:
                found.append(f"{e.kind} {e.node} at {e.at:.0f} s: pauses {e.pauses} (goal {e.goal} s)")
            if e.restarted:
                found.append(f"{e.kind} {e.node} at {e.at:.0f} s restarted untouched pipelines {e.restarted}")
        found += [f"pipeline {g}: weights {d:.2e} from one process" for g, d in self.weights.items() if d > 1e-5]
        found += [f"node {n} exited {c}" for n, c in self.codes.items() if c != 0]
        return found

    def rows(self) -> list[str]:
        """The report as table rows (markdown)."""
        lines = []
        for i, e in enumerate(self.events):
            pauses = ", ".join(f"{g}: {p:.2f}" for g, p in sorted(e.pauses.items()))
            down = f"{e.downtime:.1f}" if e.kind == "coordinator" else ""
            lines.append(
                f"| {self.seed} | {i + 1} | {e.at:.0f} | {e.kind} {e.node} | {down} | {pauses} | {e.longest():.2f} |"
            )
        return lines


class ChaosSoak:
    """The coordinator, the pipelines' nodes and the event sequence of one seed."""

    def __init__(
        self,
        folder: Path,
        seed: int,
        *,
        pipelines: int = 3,
        events: int = 8,
        gap: tuple[float, float] = (10.0, 22.0),
        step_sleep: float = 0.2,
        script: list[tuple[str, str, float]] | None = None,
    ) -> None:
        """``script``: the events to play instead of seeded ones: (kind, node, seconds to wait after it)."""
        self.script = list(script) if script is not None else None
        self.folder, self.seed, self.pipelines, self.event_count = folder, seed, pipelines, events
        self.gap, self.rng = gap, random.Random(seed)
        self.out, self.stop = folder / "out", folder / "stop"
        self.rdzv_port, self.lighthouse_port = free_port(), free_port()
        self.lighthouse = f"http://127.0.0.1:{self.lighthouse_port}"
        self.argv = [WORKER, str(self.out), "--stages", "0", "--steps", "100000", "--step-sleep", str(step_sleep)]
        self.argv += ["--stop-file", str(self.stop), "--sgd", "--step-log"]
        self.coordinator: subprocess.Popen | None = None
        self.nodes: dict[str, Agent] = {}
        self.down: set[str] = set()
        self.launches: dict[str, int] = {}
        self.started = 0.0

    # ------------------------------------------------------------------ processes
    def _start_coordinator(self) -> None:
        from tests.integration.test_coordinator import _coordinator

        self.coordinator = _coordinator(self.rdzv_port, self.lighthouse_port, self.folder / "coordinator.log")
        deadline = time.monotonic() + 90
        while not (port_open(self.rdzv_port) and port_open(self.lighthouse_port)):
            if time.monotonic() > deadline:
                raise AssertionError("the coordinator did not open its ports within 90 s")
            time.sleep(0.1)

    def _kill_coordinator(self) -> None:
        if self.coordinator is not None and self.coordinator.poll() is None:
            self.coordinator.kill()
            self.coordinator.wait()

    def _start_node(self, node: str) -> None:
        group = node[:-1]
        env = {"REPLICA_GROUP_ID": group, "TORCHFT_LIGHTHOUSE": self.lighthouse}
        self.launches[node] = self.launches.get(node, 0) + 1
        log = self.folder / f"pipeline{node}-{self.launches[node]}.log"  # (a log per launch of the node)
        self.nodes[node] = Agent(
            node, self.rdzv_port, 1, self.argv, log, nnodes="1:2", env=env, max_restarts=1000,
            rdzv_conf=f"{RDZV_CONF},is_host=false", rdzv_id=f"p{group}",
        )  # fmt: skip
        self.down.discard(node)

    def _notice(self, node: str) -> None:
        """SIGTERM to the node's agent (a scheduler's notice); it is down once it has ended."""
        agent = self.nodes[node]
        agent.signal(signal.SIGTERM)
        self.down.add(node)

    def close(self) -> None:
        for agent in self.nodes.values():
            if agent.proc.poll() is None:
                agent.kill_node()
            for pid in descendants(agent.proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self._kill_coordinator()

    # ------------------------------------------------------------------ the step history
    def history(self) -> dict[str, list[tuple[int, float]]]:
        """(step, time) of every logged step end, per process (``group{G}_rank{R}_{pid}``)."""
        found: dict[str, list[tuple[int, float]]] = {}
        folder = self.out / "steps"
        for path in folder.iterdir() if folder.exists() else []:
            rows = []
            for line in path.read_text().splitlines():
                parts = line.split()
                if len(parts) == 2:
                    rows.append((int(parts[0]), float(parts[1])))
            found[path.name] = rows
        return found

    def _pipeline_times(self, history: dict[str, list[tuple[int, float]]], group: str) -> list[float]:
        """When pipeline ``group``'s first rank ended a step (any of its processes over time)."""
        return sorted(t for name, rows in history.items() if name.startswith(f"group{group}_rank0_") for _, t in rows)

    def _pause(self, times: list[float], start: float, end: float, spanning: bool = True) -> float:
        """The longest time without a step end between ``start`` and ``end`` (``spanning``: from the last step before
        ``start``, else from ``start``)."""
        before = [t for t in times if t <= start]
        inside = [t for t in times if start < t <= end]
        points = ([before[-1]] if before and spanning else [start]) + inside
        gaps = [b - a for a, b in zip(points, points[1:])]
        tail = end - points[-1]
        return max([*gaps, tail]) if points else end - start

    def _steps_now(self) -> dict[str, int]:
        from tests.integration.test_coordinator import _live_steps

        return _live_steps(self.lighthouse)

    def _whole(self) -> list[str]:
        """Pipelines whose two nodes are up."""
        return [str(g) for g in range(self.pipelines) if not ({f"{g}a", f"{g}b"} & self.down)]

    # ------------------------------------------------------------------ the run
    def _choose(self) -> tuple[str, str]:
        """The next event: a node down comes back more often the more are down; a kill or notice never takes the last
        whole pipeline's node; the coordinator now and then."""
        up = [n for n in self.nodes if n not in self.down]
        whole = self._whole()
        hittable = [n for n in up if whole != [n[:-1]]]
        options: list[tuple[str, str]] = []
        weights: list[float] = []
        for node in hittable:
            options += [("kill", node), ("notice", node)]
            weights += [1.5 / len(hittable), 1.0 / len(hittable)]
        for node in sorted(self.down):
            options.append(("return", node))
            weights.append(1.0 * len(self.down) / len(self.down))
        options.append(("coordinator", ""))
        weights.append(0.6)
        return self.rng.choices(options, weights)[0]

    def _apply(self, kind: str, node: str) -> float:
        """Apply the event; returns when it was done (the coordinator's ports open again, for a restart)."""
        if kind == "kill":
            self.nodes[node].kill_node()
            self.down.add(node)
            return time.time()
        if kind == "notice":
            self._notice(node)
        elif kind == "return":
            self._start_node(node)
        else:  # (a scripted restart may say how long the coordinator stays down: ("coordinator", "2.0", wait))
            self._kill_coordinator()
            time.sleep(float(node) if node else self.rng.uniform(0.5, 3.0))
            self._start_coordinator()
        return time.time()

    def _wait(self, what: str, condition: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"seed {self.seed}: timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(0.3)

    def run(self) -> SoakReport:
        self.folder.mkdir(parents=True, exist_ok=True)
        begun = time.monotonic()
        try:
            self._start_coordinator()
            for g in range(self.pipelines):
                for n in "ab":
                    self._start_node(f"{g}{n}")
            self._wait(
                "every pipeline at step 10",
                lambda: len(s := self._steps_now()) == self.pipelines and min(s.values()) >= 10,
                240,
            )
            self.started = time.time()
            events: list[Event] = []
            for i in range(self.event_count if self.script is None else len(self.script)):
                kind, node = self._choose() if self.script is None else self.script[i][:2]
                at = time.time()
                done = self._apply(kind, node)
                shown = "" if kind == "coordinator" else node
                events.append(Event(kind, shown, at - self.started, downtime=round(done - at, 2)))
                time.sleep(self.rng.uniform(*self.gap) if self.script is None else self.script[i][2])
            back = sorted(self.down)  # every node back, then a few steps of every pipeline at depth 2
            for node in back:
                self._start_node(node)
            if back:
                events.append(Event("return", "+".join(back), time.time() - self.started))
            self._wait("every pipeline whole again", self._all_whole, 180)
            time.sleep(3.0)
            ended = time.time()
            self.stop.touch()
            self._wait("every node to end", lambda: all(a.proc.poll() is not None for a in self.nodes.values()), 120)
        finally:
            self.close()
        history = self.history()
        self._measure(events, history, ended)
        return SoakReport(
            seed=self.seed,
            events=events,
            start_overs=self._start_overs(history),
            hangs=self._hangs(events, history, ended),
            weights=self._weights(),
            steps=self._final_steps(),
            codes={n: a.proc.returncode for n, a in self.nodes.items()},
            seconds=time.monotonic() - begun,
        )

    def _all_whole(self) -> bool:
        """Every pipeline's two ranks stepped in the last 2 s, in processes started after the last node came back."""
        history = self.history()
        now = time.time()
        for g in range(self.pipelines):
            for r in range(2):
                recent = [rows[-1][1] for n, rows in history.items() if n.startswith(f"group{g}_rank{r}_") and rows]
                if not recent or now - max(recent) > 2.0:
                    return False
        return len(self._steps_now()) == self.pipelines

    def _measure(self, events: list[Event], history: dict[str, list[tuple[int, float]]], ended: float) -> None:
        """Each event's untouched pipelines: their longest pause until the next event, and whether they restarted."""
        for i, event in enumerate(events):
            start = self.started + event.at
            end = self.started + events[i + 1].at if i + 1 < len(events) else ended
            touched = {n[:-1] for n in event.node.split("+") if n} if event.kind != "coordinator" else set()
            for g in map(str, range(self.pipelines)):
                if g in touched:
                    continue
                if any(f"{g}{n}" in self._down_during(events, i) for n in "ab"):
                    continue  # (broken by an earlier event: not untouched)
                event.pauses[g] = round(self._pause(self._pipeline_times(history, g), start, end), 3)
                starts = [rows[0][1] for n, rows in history.items() if n.startswith(f"group{g}_") and rows]
                if any(start < t <= end for t in starts):
                    event.restarted.append(g)

    def _down_during(self, events: list[Event], index: int) -> set[str]:
        """Nodes down at any time between event ``index`` and the next (replayed from the events)."""
        down: set[str] = set()
        for e in events[: index + 1]:
            if e.kind in ("kill", "notice"):
                down.add(e.node)
            elif e.kind == "return":
                down -= set(e.node.split("+"))
        return down

    def _start_overs(self, history: dict[str, list[tuple[int, float]]]) -> list[str]:
        """Processes whose first step came more than :data:`START_OVER_STEPS` behind the newest step any process had
        ended by then (the run's progress lost; the initial start excluded)."""
        ends = sorted((t, s) for rows in history.values() for s, t in rows)
        found = []
        for name, rows in history.items():
            if not rows:
                continue
            first_step, first_time = rows[0]
            newest = max((s for t, s in ends if t < first_time), default=0)
            if newest - first_step > START_OVER_STEPS:
                found.append(f"{name} started at step {first_step} while step {newest} was held")
        return found

    def _hangs(self, events: list[Event], history: dict[str, list[tuple[int, float]]], ended: float) -> list[str]:
        """Pipelines that went :data:`HANG_S` without a step while one of their nodes was up."""
        found = []
        for g in map(str, range(self.pipelines)):
            times = self._pipeline_times(history, g)
            for start, end in self._up_spans(events, g, ended):
                pause = self._pause(times, start, end, spanning=False)
                if pause > HANG_S:
                    found.append(f"pipeline {g} went {pause:.0f} s without a step with a node up")
        return found

    def _up_spans(self, events: list[Event], group: str, ended: float) -> list[tuple[float, float]]:
        """The spans of time (wall clock) in which at least one node of pipeline ``group`` was up."""
        up, since, spans = 2, self.started, []
        for e in events:
            hit = [n for n in e.node.split("+") if n and n[:-1] == group] if e.kind != "coordinator" else []
            before = up
            up += len(hit) if e.kind == "return" else -len(hit) if e.kind in ("kill", "notice") else 0
            at = self.started + e.at
            if before > 0 and up == 0:
                spans.append((since, at))
            elif before == 0 and up > 0:
                since = at
        if up > 0:
            spans.append((since, ended))
        return spans

    def _final_steps(self) -> dict[str, int]:
        from tests.integration.test_fault_tolerance import _results

        results = _results(self.out)
        return {name: int(r["global_step"]) for name, r in results.items()}

    def _weights(self) -> dict[str, float]:
        """Each pipeline's largest parameter difference from one process trained as many steps (SGD)."""
        from tests.integration.test_fault_tolerance import _results
        from tests.workers.ft_train import BATCH, SAMPLES

        results = _results(self.out)
        found = {}
        for g in range(self.pipelines):
            ranks = [results.get(f"group{g}_rank{r}") for r in range(2)]
            if any(r is None for r in ranks):
                found[str(g)] = float("inf")
                continue
            steps = int(ranks[0]["global_step"])  # type: ignore[index]
            got = {**ranks[0]["state_dict"], **ranks[1]["state_dict"]}  # type: ignore[index]
            found[str(g)] = max_difference(got, sgd_reference(steps, BATCH, SAMPLES))
        return found


_REFERENCES: dict[int, dict[str, Any]] = {}


def sgd_reference(steps: int, batch: int, samples: int) -> dict[str, Any]:
    """The tiny model trained ``steps`` steps with SGD in one process (cached per step count)."""
    from tests.parity import reference_run
    from tests.workers.ft_train import tiny_model_kwargs

    if steps not in _REFERENCES:
        model = {k: v for k, v in tiny_model_kwargs(sgd=True).items() if k != "seed"}
        scenario = {"model": model, "loader": {"batch_size": batch, "n": samples}, "trainer": {"max_steps": steps}}
        _REFERENCES[steps] = reference_run(scenario)
    return _REFERENCES[steps]


def max_difference(got: dict[str, Any], reference: dict[str, Any]) -> float:
    """The largest absolute difference from ``reference`` (``reference_run``'s), inf when the stages together do not
    hold exactly the model's parameters."""
    want = reference["state_dict"]
    if sorted(got) != sorted(want):
        return float("inf")
    return max(float((got[k].float() - want[k].float()).abs().max()) for k in want)
