"""glibc's malloc in a training process: keep freed host memory for the next step instead of giving it back.

    setup = keep_freed_host_memory()        # every rank, once; a user's own MALLOC_* / GLIBC_TUNABLES win
    setup.describe()                        # "freed host memory kept for reuse (glibc: trim 128 MiB, mmap 32 MiB)"

A training step frees and allocates the same buffers every step: gradients (released before the
schedule), activations, collated batches, optimizer temporaries. glibc returns the free memory at the
top of its heap to the OS once more than its trim threshold is free there, and serves requests above
its mmap threshold with fresh mappings; both start low (128 KiB) and adapt only partly. Memory given
back is touched again in the next step as fresh pages, each a minor page fault that zeroes 4 KiB in
the kernel: on CPU, 300-600 faults per step on a pipeline stage of two 512x512 layers, ~1.5 ms of a
20 ms step's CPU time on every rank (``benchmarks/pipeline_throughput.py --cpu-breakdown``). With the
thresholds fixed at 128 MiB (trim) and 32 MiB (mmap, the largest glibc adapts to by itself), those
buffers stay in the process: no faults per step, at the price of up to the trim threshold of free
memory kept per heap. On GPUs the tensors live in CUDA's caching allocator; what is left (batches
collated on the host, Python objects) gains the same way, only less.

Not applied where the allocator is not glibc's (macOS, musl, jemalloc, tcmalloc or mimalloc through
``LD_PRELOAD``) or where the environment already tunes it (``MALLOC_TRIM_THRESHOLD_``,
``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TOP_PAD_``, ``MALLOC_MMAP_MAX_``, ``GLIBC_TUNABLES`` with
``glibc.malloc``), nor with ``LIGHTNING_SPOT_MALLOC=default``.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

#: mallopt's parameter numbers (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
TRIM_THRESHOLD = 128 << 20
MMAP_THRESHOLD = 32 << 20
#: the environment variable that turns this off
OPT_OUT = "LIGHTNING_SPOT_MALLOC"
_USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


@dataclass(frozen=True)
class MallocSetup:
    """Whether the thresholds were set, and why not if they were not."""

    applied: bool
    detail: str

    def describe(self) -> str:
        if self.applied:
            return f"freed host memory kept for reuse ({self.detail})"
        return f"host malloc left as it is ({self.detail})"


def _not_ours(env: dict[str, str]) -> str | None:
    """Why the thresholds should not be set here, or None."""
    if env.get(OPT_OUT, "").lower() == "default":
        return f"{OPT_OUT}=default"
    for name in _USER_SETTINGS:
        if name in env:
            return f"{name} in the environment"
    if "glibc.malloc" in env.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets glibc.malloc"
    preload = env.get("LD_PRELOAD", "")
    if "jemalloc" in preload or "tcmalloc" in preload or "mimalloc" in preload:
        return "another allocator in LD_PRELOAD"
    return None if is_glibc() else "not glibc"


def is_glibc() -> bool:
    """Whether this process runs on glibc (``os.confstr`` raises where the name is unknown and gives None where the
    C library does not answer it, as musl does)."""
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION")
    except (AttributeError, ValueError, OSError):
        return False
    return version is not None and version.startswith("glibc")


def keep_freed_host_memory(env: dict[str, str] | None = None) -> MallocSetup:
    """Fix glibc's trim and mmap thresholds for this process (see the module docstring)."""
    reason = _not_ours(dict(os.environ) if env is None else env)
    if reason is not None:
        return MallocSetup(False, reason)
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return MallocSetup(False, "no mallopt")
    # the mmap threshold first: setting either ends glibc's own adaptation of both
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return MallocSetup(False, "mallopt refused")
    return MallocSetup(True, f"glibc: trim {TRIM_THRESHOLD >> 20} MiB, mmap {MMAP_THRESHOLD >> 20} MiB")
