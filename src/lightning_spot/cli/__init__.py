"""The ``lightning-spot`` command: ``main`` dispatches to one module per subcommand."""

from lightning_spot.cli.main import main

__all__ = ["main"]
