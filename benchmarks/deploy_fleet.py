"""The deployment recipes as a local fleet (issue 63): what a notice and a lost node cost the other pipeline.

Runs ``tests/deploy_fleet.run_fleet`` ``--runs`` times: the coordinator; pipeline 0 started by the Slurm batch script
(``examples/deploy/slurm/pipeline.sbatch`` under ``SLURM_*``, with ``srun``/``scontrol`` stand-ins), pipeline 1 by the
SkyPilot managed job's ``run`` (``examples/deploy/skypilot/pipeline.yaml``'s, under its ``envs`` and ``SKYPILOT_*``),
one CPU node each, ``fault_tolerance="torchft"`` on the test model (steps of about 0.15 s). Pipeline 1's node gets a
notice (SIGTERM: it must exit 75) and is relaunched; then pipeline 0's node is SIGKILLed and requeued. Prints, per run
and as medians, how long the notice took to exit and the longest pause the other pipeline saw (the lighthouse's
steps sampled every 0.1 s). Goal (issue 63): <= 2 s with torchft.

``--restart-path``: ``tests/deploy_fleet.run_restart_fleet`` instead: two worker pods of the elastic PyTorchJob
(``examples/deploy/kubernetes/elastic-pytorchjob.yaml``'s ``lightning-spot run`` flags, the training operator's pod
environment), snapshots every step; one pod killed, the other restarts the job on itself from memory; prints the
time that restart lost (from the last step before the loss to the first after). Goal: <= 8 s.

Usage::

    python benchmarks/deploy_fleet.py             # 3 runs
    python benchmarks/deploy_fleet.py --runs 5
    python benchmarks/deploy_fleet.py --restart-path
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.deploy_fleet import run_fleet, run_restart_fleet


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--restart-path", action="store_true", help="the elastic PyTorchJob's restart path instead")
    args = parser.parse_args()
    runs = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as folder:
            figures = run_restart_fleet(Path(folder)) if args.restart_path else run_fleet(Path(folder))
        runs.append(figures)
        print(f"run {i + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()), flush=True)
    print("median: " + ", ".join(f"{k} {statistics.median(r[k] for r in runs):.2f}" for k in runs[0]))


if __name__ == "__main__":
    main()
