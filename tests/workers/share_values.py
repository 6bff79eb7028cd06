"""Two ranks share a step's logged values the way a P2 pipeline does (``LastStageBroadcast``): rank 1 holds the last
stage and sends, rank 0 receives. Before each training step rank 0 posts the receive of the step's values
(``expect``); meanwhile both ranks exchange "activations" point to point under the default tag, as
``torch.distributed.pipelining`` does, and nothing may wait on the posted receive. Each rank writes what it got:
``python share_values.py OUT``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_spot.runtime.logging_bridge import LastStageBroadcast

LAST = 1
#: (kind, names logged) of each step: the names change once in training and once in an evaluation
STEPS = [("train", ("loss",)), ("train", ("loss",)), ("train", ("loss", "acc")), ("val", ("val_loss",))]
STEPS += [("train", ("loss", "acc"))] * 3


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    share = LastStageBroadcast(dist.group.WORLD, LAST, torch.device("cpu"))
    got = []
    for step, (kind, names) in enumerate(STEPS):
        if kind == "train":
            share.expect()
            # the pipeline's own traffic in both directions while the values' receive is posted
            act = torch.full((4,), float(step))
            if rank == 0:
                dist.send(act, dst=1)
                dist.recv(act, src=1)
            else:
                dist.recv(act, src=0)
                dist.send(act * 2, dst=0)
            assert act[0].item() == step * (2 if rank == 0 else 1), "the pipeline's tensors are its own"
        payload = {name: (step + i / 10, {"on_step": True}) for i, name in enumerate(names)} if rank == LAST else None
        logged = share.logged(payload)
        got.append({name: value for name, (value, _) in logged.items()})
    share.flush()
    (out / f"rank{rank}.json").write_text(json.dumps(got))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
