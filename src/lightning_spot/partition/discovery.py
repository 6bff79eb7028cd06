"""Find the pipeline-able layer sequence of a LightningModule and what surrounds it.

    split = discover(module)                      # looks for ``module.layers``
    split = discover(module, layers="model.blocks")
    split.layer_names, split.first_modules, split.last_modules

The contract: ``forward`` runs modules registered *before* the layer sequence (embeddings),
then the sequence, then modules registered *after* it (final norm, head). Modules with
parameters before the sequence belong to the first stage, after it to the last stage;
parameter-free modules (activations, losses, torchmetrics metrics) are kept on every stage.
``first_stage_modules`` / ``last_stage_modules`` override the registration-order rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn


class ModelContractError(TypeError):
    """The LightningModule does not follow the pipeline model contract (see docs/model-contract.md)."""


@dataclass(frozen=True)
class ModelSplit:
    """Where the layer sequence is and which surrounding modules go to the first / last stage."""

    layers_path: str
    layer_names: tuple[str, ...]
    first_modules: tuple[str, ...] = ()
    last_modules: tuple[str, ...] = ()
    replicated_modules: tuple[str, ...] = ()
    #: parameters registered directly on the LightningModule or an ancestor of the sequence
    first_direct_params: tuple[str, ...] = field(default=())

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    def layer_fqn(self, index: int) -> str:
        return f"{self.layers_path}.{self.layer_names[index]}"


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def discover(
    module: nn.Module,
    layers: str = "layers",
    *,
    first_stage_modules: Sequence[str] = (),
    last_stage_modules: Sequence[str] = (),
) -> ModelSplit:
    """Locate the layer sequence ``layers`` (a dotted attribute path) and classify its surroundings."""
    parts = layers.split(".")
    ancestors: list[tuple[str, nn.Module]] = [("", module)]
    current = module
    for i, part in enumerate(parts):
        child = current._modules.get(part)
        if child is None:
            where = type(module).__name__ + ("." + ".".join(parts[:i]) if i else "")
            raise ModelContractError(
                f"{where} has no submodule '{part}'. spot_pipeline splits the model along a layer sequence: "
                f"put the repeated blocks in an `nn.Sequential` or `nn.ModuleList` attribute named `layers`, "
                f"or pass `SpotPipelineStrategy(layers='path.to.blocks')`."
            )
        current = child
        if i < len(parts) - 1:
            ancestors.append((".".join(parts[: i + 1]), child))
    seq = current
    if not isinstance(seq, (nn.Sequential, nn.ModuleList)):
        raise ModelContractError(
            f"`{layers}` is a {type(seq).__name__}; spot_pipeline needs an `nn.Sequential` or `nn.ModuleList` "
            f"whose children are the blocks to distribute over pipeline stages. Wrap the blocks in one, "
            f"or name the right attribute with `SpotPipelineStrategy(layers=...)`."
        )
    layer_names = tuple(seq._modules.keys())
    if not layer_names:
        raise ModelContractError(f"`{layers}` is empty; it must hold the model's blocks.")

    first: list[str] = []
    last: list[str] = []
    replicated: list[str] = []
    direct: list[str] = []
    for depth, (prefix, parent) in enumerate(ancestors):
        pivot = parts[depth]
        direct.extend(_join(prefix, n) for n, p in parent._parameters.items() if p is not None)
        seen_pivot = False
        for name, child in parent._modules.items():
            if name == pivot:
                seen_pivot = True
                continue
            if child is None:
                continue
            fqn = _join(prefix, name)
            if not _has_params(child):
                replicated.append(fqn)
            elif seen_pivot:
                last.append(fqn)
            else:
                first.append(fqn)

    for fqn in (*first_stage_modules, *last_stage_modules):
        if fqn not in first and fqn not in last and fqn not in replicated:
            raise ModelContractError(
                f"'{fqn}' is not a module next to the layer sequence `{layers}`; "
                f"stage overrides name modules outside it, e.g. 'embed' or 'head'."
            )
    for fqns, target in ((first_stage_modules, first), (last_stage_modules, last)):
        for fqn in fqns:
            for group in (first, last, replicated):
                if fqn in group and group is not target:
                    group.remove(fqn)
            if fqn not in target:
                target.append(fqn)

    return ModelSplit(
        layers_path=layers,
        layer_names=layer_names,
        first_modules=tuple(first),
        last_modules=tuple(last),
        replicated_modules=tuple(replicated),
        first_direct_params=tuple(direct),
    )
