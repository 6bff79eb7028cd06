"""glibc's trim and mmap thresholds: set once per rank so that a step's freed buffers are reused, not faulted in."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_spot.runtime import host_malloc
from lightning_spot.runtime.host_malloc import _not_ours, is_glibc, keep_freed_host_memory

GLIBC = is_glibc()

#: a step's pattern: twelve 1 MiB buffers written and freed, 20 times; prints the page faults of the last 10 rounds
ROUNDS = """
import ctypes, importlib.util, resource, sys
if sys.argv[1] == "tuned":
    spec = importlib.util.spec_from_file_location("host_malloc", sys.argv[2])
    module = sys.modules["host_malloc"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.keep_freed_host_memory({}).applied
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
libc.memset.restype = ctypes.c_void_p
libc.free(libc.memset(libc.malloc(4 << 20), 1, 4 << 20))  # glibc adapts its thresholds to a freed 4 MiB mapping
for i in range(20):
    if i == 10:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(1 << 20) for _ in range(12)]
    for b in blocks:
        libc.memset(b, 1, 1 << 20)
    for b in blocks:
        libc.free(b)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", ROUNDS, mode, str(Path(host_malloc.__file__))],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_freed_buffers_are_reused_instead_of_faulted_in_again() -> None:
    default, tuned = _faults("default"), _faults("tuned")
    # 10 rounds x 12 MiB given back and touched again: ~30000 faults by default; with the thresholds set, none
    assert default > 10 * 12 * 256 // 2, default
    assert tuned < 100, tuned


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({"LIGHTNING_SPOT_MALLOC": "default"}, "LIGHTNING_SPOT_MALLOC=default"),
        ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_ in the environment"),
        ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, "GLIBC_TUNABLES sets glibc.malloc"),
        ({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, "another allocator in LD_PRELOAD"),
    ],
)
def test_a_users_own_allocator_settings_win(env: dict[str, str], reason: str) -> None:
    assert _not_ours(env) == reason
    setup = keep_freed_host_memory(env)
    assert not setup.applied
    assert reason in setup.describe()


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_applied_on_glibc_and_said_so() -> None:
    setup = keep_freed_host_memory({})
    assert setup.applied
    assert setup.describe() == "freed host memory kept for reuse (glibc: trim 128 MiB, mmap 32 MiB)"
