"""The data tests fork DataLoader workers from the test process, which earlier in-process fits left process groups
in (gloo's threads live in this process only): objects of theirs that are garbage must be freed here, before a fork,
not in a worker, where the destructor of a gloo group waits for threads that were not forked (a hang)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _no_process_group_garbage_in_forked_workers() -> Iterator[None]:
    gc.collect()
    yield
