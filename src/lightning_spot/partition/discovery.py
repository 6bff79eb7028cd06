"""Find the pipeline-able layer sequence of a LightningModule and what surrounds it.

    split = discover(module)                      # finds the block sequence ("auto")
    split = discover(module, layers="model.blocks")
    split.layer_names, split.first_modules, split.last_modules
    find_layer_sequence(hf_model_module)          # "model.transformer.h", "model.model.layers", ...

The contract: ``forward`` runs modules registered *before* the layer sequence (embeddings),
then the sequence, then modules registered *after* it (final norm, head). Modules with
parameters before the sequence belong to the first stage, after it to the last stage;
parameter-free modules (activations, losses, torchmetrics metrics) are kept on every stage.
``first_stage_modules`` / ``last_stage_modules`` override the registration-order rule.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

log = logging.getLogger(__name__)

#: where placement keeps how a module was split (``placement.Placement``), on the module itself
PLACEMENT_MARK = "_spot_placement"
#: the attribute names of block sequences that need not hold blocks of one type
SEQUENCE_NAMES = ("layers", "blocks", "h")


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
    #: parameters registered directly on the LightningModule or an ancestor of the sequence ("loose"), by the stage
    #: that owns them (the first unless the step uses them only after the layers: CLIP's logit scale)
    first_direct_params: tuple[str, ...] = field(default=())
    last_direct_params: tuple[str, ...] = ()
    #: last-stage modules that the step runs before the layers without feeding them (a teacher whose output only the
    #: loss uses): they stand in on the earlier stages, before the layers too
    stand_in_before: tuple[str, ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    def layer_fqn(self, index: int) -> str:
        return f"{self.layers_path}.{self.layer_names[index]}"


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _sequence_candidates(module: nn.Module) -> list[tuple[str, int, int, str]]:
    """(path, parameters, blocks, block type) of every ``nn.Sequential`` / ``nn.ModuleList`` whose blocks are all
    of one type, or that is named like a block sequence (``layers``, ``blocks``, ``h``), most parameters first."""
    out = []
    for path, child in module.named_modules():
        if not path or not isinstance(child, (nn.Sequential, nn.ModuleList)):
            continue
        blocks = [m for m in child._modules.values() if m is not None]
        kinds = Counter(type(b).__name__ for b in blocks)
        if blocks and (len(kinds) == 1 or path.rsplit(".", 1)[-1] in SEQUENCE_NAMES):
            out.append((path, _numel(child), len(blocks), kinds.most_common(1)[0][0]))
    return sorted(out, key=lambda c: -c[1])


def find_layer_sequence(module: nn.Module) -> str:
    """The path of the model's main block sequence: the ``nn.Sequential`` / ``nn.ModuleList`` of same-type
    blocks holding the most parameters (``model.transformer.h`` in GPT-2, ``model.model.layers`` in Llama,
    ``layers``, ``blocks``). Two unrelated sequences that each hold a quarter of the model or more (an encoder
    and a decoder) are ambiguous: the error lists them."""
    candidates = _sequence_candidates(module)
    if not candidates:
        raise ModelContractError(
            f"{type(module).__name__} has no `nn.Sequential` or `nn.ModuleList` of repeated blocks to split into "
            f"pipeline stages. Put the repeated blocks in one (e.g. `self.layers`), or pass "
            f"`SpotPipelineStrategy(layers='path.to.blocks')`."
        )
    best, total = candidates[0], _numel(module)
    rivals = [  # another sequence holding a good part of the model, not inside the best one (nor around it)
        c
        for c in candidates[1:]
        if c[1] >= 0.25 * total and not c[0].startswith(best[0] + ".") and not best[0].startswith(c[0] + ".")
    ]
    if rivals and best[1] > 0:
        listed = ", ".join(f"'{p}' ({n} x {t}, {params:,} parameters)" for p, params, n, t in [best, *rivals])
        raise ModelContractError(
            f"{type(module).__name__} has several large block sequences: {listed}. Say which one to split into "
            f"pipeline stages with `SpotPipelineStrategy(layers=...)`."
        )
    share = f", {100 * best[1] / total:.0f}% of the parameters" if total else ""
    log.info("lightning-spot: splitting the layer sequence `%s` (%d x %s%s)", best[0], best[2], best[3], share)
    return best[0]


def discover(
    module: nn.Module,
    layers: str = "auto",
    *,
    first_stage_modules: Sequence[str] = (),
    last_stage_modules: Sequence[str] = (),
) -> ModelSplit:
    """Locate the layer sequence ``layers`` (a dotted attribute path, or ``"auto"``: :func:`find_layer_sequence`)
    and classify its surroundings."""
    if layers == "auto":
        placed = module.__dict__.get(PLACEMENT_MARK)  # already split: its sequence now holds placeholders
        layers = placed.split.layers_path if placed is not None else find_layer_sequence(module)
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
        if fqn not in first and fqn not in last and fqn not in replicated and fqn not in direct:
            raise ModelContractError(
                f"'{fqn}' is not a module or parameter next to the layer sequence `{layers}`; "
                f"stage overrides name modules outside it, e.g. 'embed' or 'head', or loose parameters ('pos_embed')."
            )
    last_direct = [fqn for fqn in last_stage_modules if fqn in direct]
    direct = [fqn for fqn in direct if fqn not in last_direct]
    first_stage_modules = [fqn for fqn in first_stage_modules if fqn not in direct]
    last_stage_modules = [fqn for fqn in last_stage_modules if fqn not in last_direct]
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
        last_direct_params=tuple(last_direct),
    )
