"""The ``lightning-spot`` console script: ``run`` and ``coordinator`` start without importing Lightning.

    lightning-spot coordinator ...     # lightning_spot_launch.coordinator (torch and torchft only: ~1.3 s to serve)
    lightning-spot run ...             # lightning_spot_launch.run (the agent's flags; the agent itself is light too)
    lightning-spot fit|plan|report...  # lightning_spot.cli.main (imports Lightning: ~3 s on small machines)

A coordinator that restarts and a node that comes back are on the critical path of every pipeline waiting for them:
importing ``lightning_spot`` (and with it Lightning) first would add ~2 s to each.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "coordinator":
        from lightning_spot_launch.coordinator import main as coordinator_main

        return coordinator_main(args[1:])
    if args and args[0] == "run":
        if os.getcwd() not in sys.path:  # (as lightning_spot.cli.main does for every subcommand)
            sys.path.insert(0, os.getcwd())
        from lightning_spot_launch.run import main as run_main

        return run_main(args[1:])
    from lightning_spot.cli.main import main as cli_main

    return cli_main(args)


if __name__ == "__main__":
    sys.exit(main())
