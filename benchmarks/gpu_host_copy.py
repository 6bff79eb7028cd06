"""What copying training state from a GPU to host memory costs: the ceiling for a checkpoint's stall.

    python benchmarks/gpu_host_copy.py              # 5.4 GB (a 340M-parameter model with Adam, fp32) in 450 tensors
    python benchmarks/gpu_host_copy.py --gib 1 --tensors 100

Prints, for the same tensors: allocating pinned host buffers; allocating pageable ones; copying into pinned
buffers one blocking copy at a time (``SpotCheckpoint``'s staging today) and all non-blocking then one
synchronize; copying into pageable buffers; and a device-to-device copy for scale. Without CUDA it says so
and exits 0.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch


def timed(label: str, fn: Callable[[], object], nbytes: int) -> None:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    print(f"gpu_host_copy: {label:<44} {seconds * 1000:9.1f} ms  {nbytes / seconds / 1e9:7.1f} GB/s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=5.0)
    p.add_argument("--tensors", type=int, default=450)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("CUDA is not available; skipping.")
        return 0
    numel = int(args.gib * 2**30 / 4 / args.tensors)
    sources = [torch.randn(numel, device="cuda") for _ in range(args.tensors)]
    nbytes = numel * 4 * args.tensors
    pinned: list[torch.Tensor] = []
    pageable: list[torch.Tensor] = []
    timed("allocate pinned", lambda: pinned.extend(torch.empty(numel, pin_memory=True) for _ in sources), nbytes)
    timed("allocate pageable (touched)", lambda: pageable.extend(torch.zeros(numel) for _ in sources), nbytes)

    def copy_each(into: list[torch.Tensor], non_blocking: bool) -> None:
        for target, source in zip(into, sources):
            target.copy_(source, non_blocking=non_blocking)

    for round_ in (1, 2):
        timed(f"pinned, blocking copies (round {round_})", lambda: copy_each(pinned, False), nbytes)
        timed(f"pinned, non-blocking + one sync (round {round_})", lambda: copy_each(pinned, True), nbytes)
        timed(f"pageable, blocking copies (round {round_})", lambda: copy_each(pageable, False), nbytes)
    side = [torch.empty_like(s) for s in sources]
    timed("device to device", lambda: [t.copy_(s) for t, s in zip(side, sources)], nbytes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
