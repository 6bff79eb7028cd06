"""Restart-free recovery on torchft: each pipeline of the job is a replica group; the survivors keep training.

    strategy = SpotPipelineStrategy(pipeline_stages=2, fault_tolerance="torchft")   # or TorchFT(...)

One torchrun (one rendezvous) per pipeline; a lighthouse (``TORCHFT_LIGHTHOUSE``) forms a quorum of the
pipelines before every step. The quorum's replicas split the global batch by samples; gradients are
averaged through torchft's manager, weighted by what each replica trained; the optimizer steps only when
the step commits, and a step that does not commit is run again with the new quorum. A pipeline that joins
takes the state of the same stage of a live peer, as a Lightning checkpoint, at a step boundary.
"""

from lightning_spot.torchft.config import TorchFT, resolve_fault_tolerance

__all__ = ["TorchFT", "resolve_fault_tolerance"]
