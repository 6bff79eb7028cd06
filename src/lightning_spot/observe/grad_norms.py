"""Lightning's ``grad_norm`` over the whole pipeline: the gradient norms of every stage's parameters, on every rank.

    from lightning_spot import grad_norm

    def on_before_optimizer_step(self, optimizer):
        self.log_dict(grad_norm(self.layers, norm_type=2))   # as with lightning.pytorch.utilities.grad_norm

Lightning's own ``grad_norm`` reads the parameters of the process it runs in: in a pipeline, each rank's are its
stages' only, so each rank logs its share of the norms and a total over its share (rank 0's logger writes the first
stage's), silently. This one gathers the per-parameter norms over the pipeline (a tied parameter once, under the
name one process gives it) and computes the total from all of them as Lightning does, the same on every rank. Outside
a ``spot_pipeline`` run, or with one stage, it is Lightning's.
"""

from __future__ import annotations

from typing import cast

import torch
from lightning.pytorch.utilities import grad_norm as process_grad_norm
from torch import Tensor, nn

from lightning_spot.runtime.grads import NormScope
from lightning_spot.utils.distributed import all_gather_object, world_size

#: where the running ``spot_pipeline`` job combines gradient norms (set by the strategy; None: no pipeline)
_SCOPE: NormScope | None = None


def use_scope(scope: NormScope | None) -> None:
    """(The strategy, at setup and teardown) where :func:`grad_norm` combines the stages' norms."""
    global _SCOPE
    _SCOPE = scope


def grad_norm(module: nn.Module, norm_type: float | int | str, group_separator: str = "/") -> dict[str, Tensor]:
    """Each parameter's gradient norm and their overall norm, over every stage of the pipeline; the keys and values of
    ``lightning.pytorch.utilities.grad_norm`` in one process. Collective over the pipeline: call it on every rank
    (from a hook every rank runs, such as ``on_before_optimizer_step``)."""
    scope = _SCOPE
    if scope is None or scope.group is None or world_size(scope.group) == 1:
        return cast(dict[str, Tensor], process_grad_norm(module, norm_type, group_separator))  # (tensors, in fact)
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    skip = {id(p) for p in scope.duplicates}
    grads = [(n, p.grad) for n, p in module.named_parameters() if p.grad is not None and id(p) not in skip]
    local = {}
    if grads and scope.counts:
        values = torch.stack([g.detach().norm(norm_type) for _, g in grads]).tolist()  # (one copy to the host)
        local = {f"grad_{norm_type}_norm{group_separator}{n}": v for (n, _), v in zip(grads, values)}
    norms: dict[str, float] = {}
    for part in all_gather_object(local, scope.group):
        norms.update(part)
    if not norms:
        return {}
    out = {key: torch.tensor(value) for key, value in norms.items()}
    out[f"grad_{norm_type}_norm_total"] = torch.tensor(list(norms.values())).norm(norm_type)
    return out
