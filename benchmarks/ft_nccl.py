"""One torchft pipeline on one device, its traffic between pipelines over the device's process group.

    python benchmarks/ft_nccl.py                  # CUDA: torchft's ProcessGroupBabyNCCL, bf16-mixed; CPU: gloo
    python benchmarks/ft_nccl.py --group gloo     # the same with gloo on CUDA (what the torchft mode did before)

A lighthouse in this process and one pipeline of one process (``fault_tolerance="torchft"``, replica group 0)
train the example GPT for ``--steps`` steps. Every step's gradients go through the replica group's all-reduce
(torchft calls its process group also in a quorum of one) and its commit vote. Prints the process group torchft's
manager used, the steps committed, ms per step, and the seconds spent in quorums, the all-reduce and the commit
(``ReplicaGroup.seconds``). One GPU cannot run two pipelines over NCCL (one device per rank of a communicator):
this checks the path, not the speed between GPUs. Exit status 1 if a step did not commit or the loss is not finite.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--group", choices=("auto", "gloo"), default="auto", help="gloo: force gloo (also on CUDA)")
    args = p.parse_args(argv)

    import lightning as L
    import torch

    from examples.gpt.data import ByteWindows
    from examples.gpt.model import TinyGPT
    from lightning_spot import SpotPipelineStrategy
    from lightning_spot.torchft import TorchFT, process_groups, replica_group
    from lightning_spot_launch.lighthouse import start_lighthouse

    cuda = torch.cuda.is_available()
    if args.group == "gloo":  # (what ReplicaGroup makes its groups with, told the device is the CPU)
        chosen = process_groups.cross_pipeline_group
        replica_group.cross_pipeline_group = lambda device, timeout: chosen(torch.device("cpu"), timeout)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="1", RANK="0", LOCAL_RANK="0",
        NODE_RANK="0", LOCAL_WORLD_SIZE="1",
    )  # fmt: skip
    lighthouse = start_lighthouse(0)
    torch.manual_seed(0)
    block, batch = 128, 16
    model = TinyGPT(block_size=block, d_model=args.d_model, n_layer=args.n_layer, n_head=8, max_steps=args.steps)
    data = torch.randint(0, 256, (batch * block * (args.steps + 1),), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(ByteWindows(data, block_size=block, stride=block), batch_size=batch)
    strategy = SpotPipelineStrategy(
        pipeline_stages=1,
        microbatches=2,
        fault_tolerance=TorchFT(lighthouse=lighthouse.address(), replica_group="0"),
    )
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        precision="bf16-mixed" if cuda else "32-true",
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )

    class KeepGroup(L.Callback):  # (the strategy lets its replica group go at teardown)
        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            seen["group"] = trainer.strategy.replicas

    seen: dict[str, Any] = {}
    trainer.callbacks.append(KeepGroup())
    started = time.monotonic()
    try:
        trainer.fit(model, loader)
    finally:
        lighthouse.shutdown()
    seconds = time.monotonic() - started
    group = seen.get("group")
    assert group is not None, "no torchft replica group was attached"
    kind = type(group.manager._pg._inner).__name__
    loss = float(trainer.callback_metrics.get("train_loss", float("nan")))
    device = torch.cuda.get_device_name(0) if cuda else "CPU"
    spent = ", ".join(f"{name} {value:.2f} s" for name, value in group.seconds.items())
    print(f"ft_nccl: {device}, group {kind} on {group.device}, {trainer.global_step} steps committed of {args.steps}, "
          f"{1000 * seconds / max(trainer.global_step, 1):.1f} ms/step (setup included), {spent}, "
          f"discarded {group.discarded}, final train_loss {loss:.4f}")  # fmt: skip
    ok = trainer.global_step == args.steps and group.discarded == 0 and math.isfinite(loss)
    print("ft_nccl: OK" if ok else "ft_nccl: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
