"""How fast a joining pipeline takes a live peer's state (issue 25): torchft's two checkpoint transports, measured
on the same transfer, one process sending and one receiving.

    python benchmarks/heal_transport.py                  # 192 MiB (the width-2048 test model with Adam), 3 rounds
    python benchmarks/heal_transport.py --mib 48 --rounds 5

Transports: ``http`` (torchft's default: the peer serves its state over HTTP and the joiner fetches it whole),
``http-4`` (the same in 4 chunks fetched in parallel), ``pg`` (sent over the replica group's process group, gloo
here: what ``TorchFT(transport="pg")`` uses). The state is a stage's payload as :func:`~lightning_spot.
fault_tolerance.heal.stage_state` gives it: weights and two Adam moments per layer, and a few small values. Rounds
alternate the transports; the script prints each one's median seconds and MiB/s (receive, end to end: the sender's
serialisation included).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TRANSPORTS = ("http", "http-4", "pg")
TIMEOUT = timedelta(seconds=60)


def _state(mib: int) -> dict[str, Any]:
    """A stage's payload of about ``mib`` MiB: layers of weights and Adam moments, 16 MiB tensors at most."""
    side = 1024
    tensors_per_layer = 3
    layers = max(1, round(mib * 2**20 / (side * side * 4 * tensors_per_layer)))
    weights = {f"layers.{i}.fc.weight": torch.randn(side, side) for i in range(layers)}
    moments = {f"state.layers.{i}.fc.weight.{m}": torch.randn(side, side) for i in range(layers) for m in ("a", "b")}
    return {
        "stage": {"tensors": {"model": weights, "optimizer_0": moments}, "rng": [1, 2, 3], "lightning": {"step": 7}},
        "samples_seen": 123,
    }


def _nbytes(state: dict[str, Any]) -> int:
    return sum(t.nbytes for group in state["stage"]["tensors"].values() for t in group.values())


def _transport(kind: str) -> Any:
    from torchft.checkpointing.http_transport import HTTPTransport
    from torchft.checkpointing.pg_transport import PGTransport

    if kind == "pg":
        return PGTransport(dist.group.WORLD, timeout=TIMEOUT, device=torch.device("cpu"))
    return HTTPTransport(timeout=TIMEOUT, num_chunks=4 if kind == "http-4" else 0)


def _worker(rank: int, port: int, mib: int, rounds: int, out: Any) -> None:
    from http.server import BaseHTTPRequestHandler

    BaseHTTPRequestHandler.log_message = lambda *args: None  # type: ignore[method-assign]  # (a line per request)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    store = dist.distributed_c10d._get_default_store()
    state = _state(mib) if rank == 0 else None
    transports = {kind: _transport(kind) for kind in TRANSPORTS}
    seconds: dict[str, list[float]] = {kind: [] for kind in TRANSPORTS}
    step = 0
    for _ in range(rounds):
        for kind, transport in transports.items():
            step += 1
            dist.barrier()
            started = time.perf_counter()
            if rank == 0:
                if kind != "pg":
                    store.set(f"meta{step}", transport.metadata())
                transport.send_checkpoint(dst_ranks=[1], step=step, state_dict=state, timeout=TIMEOUT)
                dist.barrier()  # the receiver has it
                if kind != "pg":
                    transport.disallow_checkpoint()
            else:
                meta = store.get(f"meta{step}").decode() if kind != "pg" else "<n/a>"
                got = transport.recv_checkpoint(src_rank=0, metadata=meta, step=step, timeout=TIMEOUT)
                seconds[kind].append(time.perf_counter() - started)
                if step == 1:
                    out.put(_nbytes(got))
                dist.barrier()
    if rank == 1:
        out.put(seconds)
    for transport in transports.values():
        transport.shutdown(wait=False)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=192, help="the state's size")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, port, args.mib, args.rounds, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
        if p.exitcode != 0:
            for q in procs:
                q.kill()
            sys.exit(f"a process failed (exit code {p.exitcode})")
    nbytes, seconds = out.get(), out.get()
    print(f"state: {nbytes / 2**20:.0f} MiB, {args.rounds} rounds, one sender and one receiver on this machine")
    for kind, values in seconds.items():
        median = statistics.median(values)
        print(
            f"  {kind:7s} median {median:.3f} s ({nbytes / 2**20 / median:.0f} MiB/s); "
            f"rounds {', '.join(f'{v:.3f}' for v in values)}"
        )


if __name__ == "__main__":
    os.environ.setdefault("RUST_LOG", "warn")
    main()
