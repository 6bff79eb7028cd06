"""``lightning-spot deploy``: write the recipe that runs a training script on a spot fleet, and say how to start it.

    lightning-spot deploy kubernetes --pipelines 3 --nodes 2 --gpus 8 --image ghcr.io/me/train:1 -- train.py --lr 3e-4
    lightning-spot deploy skypilot --gpu-type A100 --out deploy/sky                # the example GPT, 2 pipelines
    lightning-spot deploy slurm --nodes 4 -- train.py --fault-tolerance torchft

SkyPilot, Kubernetes and Slurm: the coordinator on a node that stays and one scheduler job per pipeline
(``fault_tolerance="torchft"``; ``--restart-path`` on Kubernetes: one elastic PyTorchJob instead), exit codes and
grace periods as each scheduler reads them. The script's own arguments follow ``--`` (default: the example GPT's,
with torchft and its checkpoints in ``--checkpoints``). ``examples/deploy`` is this command's output with its
defaults. See docs/deploy.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from lightning_spot.cli.deploy_recipes import SCHEDULERS, Fleet, commands, recipes


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    script: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, script = argv[:at], argv[at + 1 :]
    parser = argparse.ArgumentParser(
        prog="lightning-spot deploy", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("scheduler", choices=SCHEDULERS)
    parser.add_argument("--pipelines", type=int, default=2, help="pipelines, one scheduler job each (default 2)")
    parser.add_argument("--nodes", type=int, default=2, help="nodes per pipeline (its stages; default 2)")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per node (default 8)")
    parser.add_argument("--gpu-type", default="H100", help="SkyPilot's accelerator name (default H100)")
    parser.add_argument("--image", default="IMAGE", help="Kubernetes: the image with your code and lightning-spot")
    parser.add_argument("--checkpoints", default="s3://my-bucket/runs/gpt", help="the example GPT's --checkpoint-dir")
    parser.add_argument("--restart-path", action="store_true", help="Kubernetes: one elastic PyTorchJob, no torchft")
    parser.add_argument("--shutdown-timeout", type=int, default=25, help="seconds to stop after a notice (default 25)")
    parser.add_argument("--out", default=None, help="folder for the files (default deploy/SCHEDULER)")
    args = parser.parse_args(argv)
    if args.pipelines < 1 or args.nodes < 1 or args.gpus < 1:
        parser.error("--pipelines, --nodes and --gpus must be at least 1")
    if args.restart_path and args.scheduler != "kubernetes":
        parser.error("--restart-path is for kubernetes (SkyPilot and Slurm: one job per pipeline)")
    fleet = Fleet(
        pipelines=args.pipelines,
        nodes=args.nodes,
        gpus=args.gpus,
        gpu_type=args.gpu_type,
        image=args.image,
        checkpoints=args.checkpoints,
        script=script[0] if script else Fleet.script,
        args=tuple(script[1:]) if script else None,
        restart_path=args.restart_path,
        shutdown_timeout=args.shutdown_timeout,
        slurm_shutdown_timeout=max(args.shutdown_timeout, Fleet.slurm_shutdown_timeout),
    )
    out = Path(args.out or f"deploy/{args.scheduler}")
    out.mkdir(parents=True, exist_ok=True)
    for name, text in recipes(args.scheduler, fleet, str(out)).items():
        path = out / name
        path.write_text(text)
        if name.endswith(".sbatch"):
            path.chmod(0o755)
        print(f"lightning-spot deploy: wrote {path}")
    if args.scheduler == "kubernetes" and fleet.image == "IMAGE":
        print("lightning-spot deploy: set --image (an image with your code and lightning-spot)", file=sys.stderr)
    print("start it with:\n  " + "\n  ".join(commands(args.scheduler, fleet, str(out))))
    return 0
