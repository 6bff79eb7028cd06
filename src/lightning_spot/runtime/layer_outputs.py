"""Per-layer outputs of a transformers model that the last pipeline stage holds only in part.

A mixture-of-experts model asked for its routers' logits (``output_router_logits=True``) adds a load-balancing
loss computed over the router logits of **every** layer. Cut into pipeline stages, the last stage runs only its
own layers (the others pass the hidden state through), so that loss would cover a part of the layers and
training would differ from one process without a word. Such outputs are refused instead.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_spot.partition.discovery import ModelContractError


def refuse_partial_router_logits(model: nn.Module, output: Any, stages: int, training: bool) -> None:
    """Raise if ``output`` of transformers ``model`` (run on the last of ``stages`` pipeline stages) carries router
    logits that its loss is computed from (``aux_loss`` with a ``loss``), or that a training step asked for."""
    if stages <= 1 or output is None:
        return
    aux_loss, router_logits = getattr(output, "aux_loss", None), getattr(output, "router_logits", None)
    in_loss = aux_loss is not None and getattr(output, "loss", None) is not None
    if not in_loss and not (training and router_logits is not None):
        return
    raise ModelContractError(
        f"`{type(model).__name__}` returned its routers' logits (`output_router_logits=True`: a mixture-of-experts "
        f"load-balancing loss{' is part of its loss' if in_loss else ', or logits to build one'}) while the model is "
        f"cut into {stages} pipeline stages. The last stage holds only its own layers' router logits, so that loss "
        f"would cover a part of the layers and training would differ from one process. Set "
        f"`output_router_logits=False` in the model's config (and do not pass it to the model) to train without the "
        f"auxiliary loss, or train with `pipeline_stages=1`."
    )
