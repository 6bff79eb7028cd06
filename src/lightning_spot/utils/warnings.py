"""Warnings that Lightning shows under every strategy but that ask nothing of a user, hidden where they arise.

Each filter names one message and the one module it is raised from; every other warning stays.
"""

from __future__ import annotations

import warnings


def hide_inapplicable_warnings() -> None:
    """Install the filters (idempotent; called when ``lightning_spot`` is imported)."""
    # Lightning 2.5/2.6 builds torch's deprecated ``LeafSpec()`` when it flattens the dataloaders of a
    # loop (lightning/pytorch/utilities/_pytree.py); torch >= 2.10 warns about the class on every
    # process. Nothing in the user's code can change that.
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
        module=r"lightning\.pytorch\.utilities\._pytree",
    )
