"""Workers forked from a server that has imported the heavy modules once: a restarted worker starts in
milliseconds instead of importing torch and Lightning again (4-7 s per restart on a 2-core machine).

    entrypoint, args = forked_entrypoint(script, script_args, module=False, extra=["transformers"])
    # the agent starts workers with start_method="forkserver": each one is a fork of the preloaded server

The server is multiprocessing's fork server: it starts with the agent's first workers (paying the imports
once), lives as long as the agent, and every later worker is a fork of it. Modules imported there must not
start threads or touch a GPU (torch, Lightning and lightning_spot do neither when imported).
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import sys
from collections.abc import Callable, Sequence

#: imported once by the fork server: what every training script here pays for at start
PRELOAD = (
    "torch",
    "torch.distributed",
    "lightning.pytorch",
    "lightning_spot",
    "lightning_spot.strategy",
    "lightning_spot.checkpoint.callback",
)


def run_script(script: str, *script_args: str) -> None:
    """Run ``script`` as ``python script.py args`` would: as ``__main__``, its directory first on the path."""
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    _as_python_does(lambda: runpy.run_path(script, run_name="__main__"))


def run_module(module: str, *script_args: str) -> None:
    """Run ``module`` as ``python -m module args`` would."""
    sys.argv = [module, *script_args]
    _as_python_does(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True))


def _as_python_does(run: Callable[[], object]) -> None:
    """An exception that ends ``run`` goes to ``sys.excepthook``, as in an interpreter that runs a script (the
    failure handling of lightning_spot sets its exit code there), and the process exits with code 1; without this,
    multiprocessing's wrapper would take it and exit with 1 whatever the hook would have said."""
    try:
        run()
    except SystemExit:
        raise
    except BaseException:
        sys.excepthook(*sys.exc_info())
        raise SystemExit(1) from None


def forked_entrypoint(
    script: str, script_args: Sequence[str], *, module: bool, extra: Sequence[str] = ()
) -> tuple[Callable[..., None], tuple[str, ...]]:
    """Set the fork server's preloads (before the agent starts workers) and return the workers' entry point
    with its arguments."""
    multiprocessing.set_forkserver_preload([*PRELOAD, *extra])
    os.environ.setdefault("PYTHONUNBUFFERED", "1")  # as torchrun's ``python -u``: the server and its forks
    return (run_module if module else run_script), (script, *script_args)
