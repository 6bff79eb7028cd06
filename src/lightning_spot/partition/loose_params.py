"""Stand-ins for the loose parameters of other stages: ``nn.Parameter``s set directly on the LightningModule (or on a
module that holds the layer sequence), such as a ViT's class token, a learned position table or CLIP's logit scale.

    module.pos = LooseStandIn(module.pos, "pos", owner="first")   # on a stage that does not own it

The step reads a loose parameter as a tensor (``self.pos[:T]``), not by calling a module, so a
:class:`~lightning_spot.partition.stage_run.RemoteModule` cannot stand in for it. A :class:`LooseStandIn` is a meta
tensor that, in every torch operation, takes the value a remote module's output would have (see
:func:`~lightning_spot.partition.stage_run.stand_in_fill`): a constant on the run's device where the step's result
does not depend on it, an error naming it where it does. It owns no memory and is not a parameter of the module.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from lightning_spot.partition.discovery import ModelContractError
from lightning_spot.partition.stage_run import stand_in_fill


class MisplacedParameterError(RuntimeError):
    """A loose parameter used on a stage that does not hold it. (Not a ``TypeError`` like
    :class:`ModelContractError`: torch turns those, raised in an operator such as ``*``, into "unsupported operand".)"""


#: reading these tells only the tensor's shape or type: no value is needed, and none is stood in for
_METADATA = frozenset({"size", "dim", "ndimension", "numel", "__len__", "nelement", "is_floating_point"})


class LooseStandIn(torch.Tensor):
    """A meta tensor shaped like the loose parameter ``fqn`` of the ``owner`` stage; in operations, the stand-in
    value of the active run (``anywhere``: also before the layers of the first stage and after them on the last)."""

    fqn: str
    owner: str
    anywhere: bool

    @staticmethod
    def __new__(cls, like: torch.Tensor, fqn: str, owner: str, anywhere: bool = False) -> LooseStandIn:
        meta = torch.empty_like(like, device="meta", requires_grad=False)
        made = torch.Tensor._make_subclass(cls, meta, False)
        made.fqn, made.owner, made.anywhere = fqn, owner, anywhere
        return made

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        reads_metadata = name == "__get__" or name in _METADATA

        def real(value: Any) -> Any:
            if not isinstance(value, LooseStandIn):
                return value
            with torch._C.DisableTorchFunctionSubclass():
                meta = value.as_subclass(torch.Tensor)
            if reads_metadata:
                return meta
            try:
                device, fill = stand_in_fill(value.fqn, value.owner, value.anywhere, (args, kwargs), "Parameter")
            except ModelContractError as err:
                raise MisplacedParameterError(str(err)) from None
            return meta if device is None else torch.full(meta.shape, fill, dtype=meta.dtype, device=device)

        args, kwargs = tree_map(real, args), tree_map(real, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"LooseStandIn({self.fqn!r} of the {self.owner} stage, shape={tuple(self.shape)})"
