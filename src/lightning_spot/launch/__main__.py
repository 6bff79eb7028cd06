"""``python -m lightning_spot.launch <torchrun flags> script.py [args]``."""

import sys

from lightning_spot.launch.agent import main

sys.exit(main(sys.argv[1:]))
