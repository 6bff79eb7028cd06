"""Three ranks reduce small tensors with the reducer the last stages use for a step's logged values
(``group_reducer``: point-to-point messages over gloo) and with ``dist.all_reduce``, while each rank has a
pipeline-like tensor in flight to its neighbour under the default tag. Each rank writes what it got:
``python exchange_reduce.py OUT``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_spot.runtime.logging_bridge import exchange_reduce, group_reducer

STEPS = 4


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    reducer = group_reducer(dist.group.WORLD)
    assert reducer is not None
    got = []
    for step in range(STEPS):
        # the pipeline's own traffic: a send to the next rank, received only after the reductions
        sent = torch.full((3,), float(rank + 10 * step))
        incoming = torch.empty(3)
        pipeline = [
            dist.isend(sent, dst=(rank + 1) % size),
            dist.irecv(incoming, src=(rank - 1) % size),
        ]
        generator = torch.Generator().manual_seed(100 * step + rank)
        values = torch.randn(2, 5, generator=generator, dtype=torch.float32) * 10 ** (3 * rank)
        sums, highs = values.clone(), values[0].clone()
        reducer(sums, dist.ReduceOp.SUM)
        reducer(highs, dist.ReduceOp.MAX)
        expected_sums, expected_highs = values.clone(), values[0].clone()
        dist.all_reduce(expected_sums, op=dist.ReduceOp.SUM)
        dist.all_reduce(expected_highs, op=dist.ReduceOp.MAX)
        lows, expected_lows = values[1].clone(), values[1].clone()
        exchange_reduce(lows, dist.ReduceOp.MIN, dist.group.WORLD)  # (no exchange for this one: an all-reduce)
        dist.all_reduce(expected_lows, op=dist.ReduceOp.MIN)
        for work in pipeline:
            work.wait()
        assert incoming[0].item() == (rank - 1) % size + 10 * step, "the pipeline's tensors are its own"
        got.append(
            {
                "sums": sums.flatten().double().tolist(),
                "expected_sums": expected_sums.flatten().double().tolist(),
                "highs": highs.double().tolist(),
                "expected_highs": expected_highs.double().tolist(),
                "lows": lows.double().tolist(),
                "expected_lows": expected_lows.double().tolist(),
            }
        )
    (out / f"rank{rank}.json").write_text(json.dumps(got))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
