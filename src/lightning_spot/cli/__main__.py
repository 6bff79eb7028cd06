"""``python -m lightning_spot.cli ...``: the same as the ``lightning-spot`` command."""

import sys

from lightning_spot.cli.main import main

sys.exit(main())
