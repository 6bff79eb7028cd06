"""A seeded chaos soak of torchft pipelines on a coordinator (issue 71): faults in sequence never stop a pipeline they
did not touch, never start the run over, and the weights end equal to one process.

Each seed runs ``tests/chaos.ChaosSoak``: the coordinator (``lightning-spot coordinator``), three pipelines of two
one-process nodes (an agent per node, ``--nnodes 1:2``, each pipeline its own rendezvous on the coordinator's store,
``fault_tolerance="torchft"``), the tiny model trained with SGD (steps of ~0.2 s), and a seeded sequence of events
10-22 s apart: a node SIGKILLed, a notice (SIGTERM to a node's agent), a node that was down started again, the
coordinator SIGKILLed and started again on its ports 0.5-3 s later. Never every pipeline at once: at least one stays
whole. At the end every node comes back, and the run ends a few seconds later.

Prints, per seed, a row per event (when, what, the coordinator's downtime, the longest pause of each pipeline the
event did not touch until the next event), the start-overs (a process whose first step came behind the steps the live
pipelines held), hangs (a pipeline with a node up and no step for 60 s), each pipeline's parameter difference from
one process, and the failures against the goals; then one line over all seeds. Goals: 0 start-overs, 0 hangs,
untouched pipelines' longest pause <= 2 s for node events (2 s per pipeline restarted, when nodes of several come
back at once) and <= 5 s for a coordinator restart (downtime included),
weights <= 1e-5 from one process.

Usage::

    python benchmarks/chaos_soak.py                      # seeds 1..20, 8 events each (~1 h on 2 cores)
    python benchmarks/chaos_soak.py --seeds 3 7 --events 10
    python benchmarks/chaos_soak.py --first 21 --count 5 --out runs/chaos   # keep the logs
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.chaos import ChaosSoak, SoakReport

HEADER = "| seed | # | at (s) | event | coordinator down (s) | untouched pipelines' longest pause (s) | longest |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="*", default=None, help="these seeds (default: --first..)")
    parser.add_argument("--first", type=int, default=1)
    parser.add_argument("--count", type=int, default=20)
    parser.add_argument("--events", type=int, default=8)
    parser.add_argument("--pipelines", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="keep each seed's logs in OUT/seed-N")
    args = parser.parse_args()
    seeds = args.seeds if args.seeds else list(range(args.first, args.first + args.count))
    reports: list[SoakReport] = []
    for seed in seeds:
        with tempfile.TemporaryDirectory() as scratch:
            folder = (args.out / f"seed-{seed}") if args.out else Path(scratch) / f"seed-{seed}"
            try:
                report = ChaosSoak(folder, seed, pipelines=args.pipelines, events=args.events).run()
            except AssertionError as err:  # (the soak could not go on: counted as a hang)
                print(f"seed {seed}: {err}".splitlines()[0], flush=True)
                continue
        reports.append(report)
        print(f"\nseed {seed} ({report.seconds:.0f} s)\n{HEADER}\n|---|---|---|---|---|---|---|", flush=True)
        print("\n".join(report.rows()))
        worst = max(report.weights.values())
        print(f"start-overs: {len(report.start_overs)}, hangs: {len(report.hangs)}, weights: {worst:.1e} from one "
              f"process, steps {min(report.steps.values())}; failures: {report.failures() or 'none'}", flush=True)  # fmt: skip
    node = [e.longest() for r in reports for e in r.events if e.kind != "coordinator" and e.pauses]
    coordinator = [e.longest() for r in reports for e in r.events if e.kind == "coordinator" and e.pauses]
    failed = [r.seed for r in reports if r.failures()]
    print(
        f"\n{len(reports)}/{len(seeds)} seeds ran, {sum(len(r.events) - 1 for r in reports)} events; "
        f"start-overs {sum(len(r.start_overs) for r in reports)}, hangs {sum(len(r.hangs) for r in reports)}; "
        f"untouched pipelines' longest pause: node events {max(node, default=0):.2f} s (goal 2), coordinator "
        f"restarts {max(coordinator, default=0):.2f} s (goal 5); weights "
        f"{max((max(r.weights.values()) for r in reports), default=0):.1e}; seeds with failures: {failed or 'none'}"
    )


if __name__ == "__main__":
    main()
