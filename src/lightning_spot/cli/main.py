"""The ``lightning-spot`` command.

    lightning-spot fit --config config.yaml      # LightningCLI, with strategy: spot_pipeline available
    lightning-spot validate|test|predict ...

The LightningCLI subcommands import ``lightning_spot`` first, so that ``strategy: spot_pipeline``
works in YAML without any import in the user's code. The model and data are given by
``class_path`` in the config (``model: {class_path: my_pkg.MyModule, init_args: {...}}``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test", "predict")


USAGE = """usage: lightning-spot {fit,validate,test,predict} [--config CONFIG.yaml] [LightningCLI options]
       lightning-spot checkpoint {list,inspect,convert} URL [OUT] [--storage-options JSON]
       lightning-spot plan --model PKG.MODULE:CLASS --world-size N --device-memory 80GB --global-batch B [--json]
       lightning-spot report RUN_URL [--png RUN.png] [--json] [--storage-options JSON]
       lightning-spot timeline DIR [--no-png] [--storage-options JSON]
       lightning-spot run [--nnodes MIN:MAX] [--nproc-per-node N] [--rdzv-endpoint HOST:PORT] SCRIPT [ARGS]
       lightning-spot coordinator [--rdzv-port 29400] [--lighthouse-port 29510] [--no-lighthouse]
       lightning-spot deploy {skypilot,kubernetes,slurm} [--pipelines N] [--nodes N] [--gpus N] [-- SCRIPT ARGS]

fit/validate/test/predict: PyTorch Lightning's CLI; `strategy: spot_pipeline` (or a
SpotPipelineStrategy class_path) works in the YAML. `lightning-spot fit --help` lists every option.
checkpoint: list, inspect or export (single-file state dict) the checkpoints of a run.
plan: profile a model and print the layout (P x D, micro-batches, schedule, cuts) the planner chooses.
report: what happened to a run (layouts, preemptions, time lost, checkpoint stall, throughput).
timeline: merge the per-rank traces of a stopped run and draw its Gantt chart.
run: launch SCRIPT with torchrun, set up for elastic restarts after preemptions.
coordinator: the rendezvous store and torchft lighthouse of a spot job, one process on a node that stays.
deploy: write the SkyPilot, Kubernetes or Slurm recipe of a spot fleet for a script, and how to start it.
"""


def lightning_cli(argv: Sequence[str]) -> None:
    """Run LightningCLI with ``argv`` after registering the spot_pipeline strategy."""
    try:
        from lightning.pytorch.cli import LightningCLI
    except ImportError as err:  # pragma: no cover - depends on the install
        raise SystemExit(f"{err}\nThe CLI needs the 'cli' extra: pip install 'lightning-spot[cli]'") from err

    import lightning_spot  # noqa: F401  registers "spot_pipeline"

    LightningCLI(args=list(argv), save_config_kwargs={"overwrite": True})


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    # like `python -m`, let class paths and --model name modules of the current directory
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if args[0] in LIGHTNING_SUBCOMMANDS:
        lightning_cli(args)
        return 0
    if args[0] == "plan":
        from lightning_spot.cli.plan import main as plan_main

        return plan_main(args[1:])
    if args[0] == "run":
        from lightning_spot_launch.run import main as run_main

        return run_main(args[1:])
    if args[0] == "coordinator":
        from lightning_spot_launch.coordinator import main as coordinator_main

        return coordinator_main(args[1:])
    if args[0] == "deploy":
        from lightning_spot.cli.deploy import main as deploy_main

        return deploy_main(args[1:])
    if args[0] == "timeline":
        from lightning_spot.cli.timeline import main as timeline_main

        return timeline_main(args[1:])
    if args[0] == "report":
        from lightning_spot.cli.report import main as report_main

        return report_main(args[1:])
    if args[0] == "checkpoint":
        from lightning_spot.cli.checkpoint import main as checkpoint_main

        return checkpoint_main(args[1:])
    print(f"lightning-spot: unknown command {args[0]!r}\n\n{USAGE}", file=sys.stderr)
    return 2
