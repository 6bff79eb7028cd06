"""The deployment recipes as a local fleet (issue 63): what a notice and a lost node cost the other pipeline.

Runs ``tests/deploy_fleet.run_fleet`` ``--runs`` times: the coordinator; pipeline 0 started by the Slurm batch script
(``examples/deploy/slurm/pipeline.sbatch`` under ``SLURM_*``, with ``srun``/``scontrol`` stand-ins), pipeline 1 by the
SkyPilot managed job's ``run`` (``examples/deploy/skypilot/pipeline.yaml``'s, under its ``envs`` and ``SKYPILOT_*``),
one CPU node each, ``fault_tolerance="torchft"`` on the test model (steps of about 0.15 s). Pipeline 1's node gets a
notice (SIGTERM: it must exit 75) and is relaunched; then pipeline 0's node is SIGKILLed and requeued. Prints, per run
and as medians, how long the notice took to exit and the longest pause the other pipeline saw (the lighthouse's
steps sampled every 0.1 s), and checks that each pipeline ends equal to one process. Goal (issue 63): <= 2 s with
torchft.

``--kubernetes``: pipeline 1 as a pod of the Kubernetes recipe's Indexed Job instead
(``examples/deploy/kubernetes/torchft-pipelines.yaml``: its container's command and environment, the pod's hostname
and completion index); the notice is the pod's deletion, the relaunch the pod made again.

``--restart-path``: ``tests/deploy_fleet.run_restart_fleet`` instead: two worker pods of the elastic PyTorchJob
(``examples/deploy/kubernetes/elastic-pytorchjob.yaml``'s ``lightning-spot run`` flags, the training operator's pod
environment), snapshots every step; one pod killed, the other restarts the job on itself from memory; prints the
time that restart lost (from the last step before the loss to the first after). Goal: <= 8 s.

Usage::

    python benchmarks/deploy_fleet.py             # 3 runs
    python benchmarks/deploy_fleet.py --runs 5
    python benchmarks/deploy_fleet.py --kubernetes
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
from tests.integration.test_fault_tolerance import _reference, _results
from tests.parity import assert_same_params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--restart-path", action="store_true", help="the elastic PyTorchJob's restart path instead")
    parser.add_argument("--kubernetes", action="store_true", help="pipeline 1 as a pod of the Kubernetes Indexed Job")
    args = parser.parse_args()
    runs = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as folder:
            if args.restart_path:
                figures = run_restart_fleet(Path(folder))
            else:
                figures = run_fleet(Path(folder), "kubernetes" if args.kubernetes else "skypilot")
                for group, result in sorted(_results(Path(folder) / "out").items()):  # (each pipeline's end)
                    assert_same_params(result["state_dict"], _reference(result["global_step"]))
                    print(f"{group}: equal to one process at step {result['global_step']}", flush=True)
        runs.append(figures)
        print(f"run {i + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()), flush=True)
    print("median: " + ", ".join(f"{k} {statistics.median(r[k] for r in runs):.2f}" for k in runs[0]))


if __name__ == "__main__":
    main()
