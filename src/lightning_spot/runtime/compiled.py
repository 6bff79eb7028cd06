"""``torch.compile(model)`` as Lightning's users write it, on a pipeline: each layer a stage owns is compiled.

    trainer.fit(torch.compile(model))   # Lightning hands the strategy the module with compiled step functions

Lightning compiles the module's ``forward`` and step functions whole (``from_compiled``). A pipeline stage replays
the step around its own layers (stand-ins for the other stages' modules, the layers of other stages passing their
input through, the first stage leaving the step after its last layer), which one compiled graph of the step cannot
follow. So the step functions go back to the module's own (Lightning's ``to_uncompiled``), and each layer of the
sequence that a stage owns gets its ``forward`` compiled with the user's compiler (its backend and options): one
block at a time, as torchtitan compiles transformer blocks. Placement (:func:`place_stages`) applies it.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.utilities.compile import to_uncompiled

from lightning_spot.partition.stage_run import Compiler


def take_compiler(module: Any) -> Compiler | None:
    """The compiler of a module that came from ``torch.compile`` (Lightning marks it), with its step functions put
    back as they were; None for a module that was not compiled."""
    ctx = getattr(module, "_compiler_ctx", None)
    if not ctx:
        return None
    compiler: Compiler = ctx["dynamo_ctx"]
    to_uncompiled(module)
    return compiler


class CompiledModule:
    """A strategy mixin: the Trainer sets ``strategy._lightning_module`` before it checks that the strategy supports
    ``torch.compile``; a compiled module's step functions are put back here, and its compiler kept for the layers
    (``_compiler``), so the check passes and placement compiles per layer."""

    @property
    def _lightning_module(self) -> Optional[pl.LightningModule]:
        return self.__dict__.get("_spot_module")

    @_lightning_module.setter
    def _lightning_module(self, module: Optional[pl.LightningModule]) -> None:
        compiler = take_compiler(module)
        if compiler is not None:
            self.__dict__["_spot_compiler"] = compiler
        self.__dict__["_spot_module"] = module

    @property
    def _compiler(self) -> Optional[Compiler]:
        return self.__dict__.get("_spot_compiler")
