"""``python -m lightning_spot_launch <torchrun flags> script.py [args]``."""

import sys

from lightning_spot_launch.agent import main

sys.exit(main(sys.argv[1:]))
