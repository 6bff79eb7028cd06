"""Keep only this rank's stages of a LightningModule, materialised on its device.

    stages = place_stages(module, split, plan, pp_rank=1, device=torch.device("cuda:1"))
    module.state_dict().keys()      # only the parameters of stages on pp rank 1, original names

Everything else is swapped for placeholders that own no tensors: layers of other stages pass their
input through, modules of other stages compute on the meta device. Modules built on the meta device
(``configure_model`` / ``init_module(empty_init=True)``) are materialised here with
``reset_parameters()`` under a seed derived from the module's name, so the initial weights do not
depend on the layout.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_spot.partition.cuts import StagePlan
from lightning_spot.partition.discovery import PLACEMENT_MARK, ModelContractError, ModelSplit
from lightning_spot.partition.loose_params import LooseStandIn
from lightning_spot.partition.partial_saves import refuse_partial_saves
from lightning_spot.partition.stage_run import (
    Compiler,
    RemoteModule,
    SkippedLayer,
    _all_meta,
    activation_parameter,
    instrument_layer,
    meta_copy,
    own_forward,
)

_MARK = PLACEMENT_MARK


@dataclass(frozen=True)
class Placement:
    """How a module was split on this process (kept on the module, so a second Trainer can reuse it)."""

    split: ModelSplit
    plan: StagePlan
    pp_rank: int
    stages: dict[int, PlacedStage]
    ties: tuple[TiedParameter, ...] = ()
    #: what runs calls of the model outside steps across the pipeline (``runtime.outside_calls.OutsideCalls``)
    outside: Any = None


def _child(parent: nn.Module, name: str) -> nn.Module:
    child = parent._modules[name]
    assert child is not None
    return child


def placement_of(module: nn.Module) -> Placement | None:
    """The placement already applied to ``module`` in this process, if any."""
    return module.__dict__.get(_MARK)


@dataclass
class PlacedStage:
    """The modules and loose parameters one pipeline stage owns on this rank."""

    stage: int
    modules: list[nn.Module] = field(default_factory=list)
    params: list[nn.Parameter] = field(default_factory=list)


def _resolve(root: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    *parents, leaf = fqn.split(".")
    parent = root
    for part in parents:
        parent = _child(parent, part)
    return parent, leaf


def stage_of_parameter(name: str, split: ModelSplit, plan: StagePlan) -> int | None:
    """The stage that owns parameter ``name`` (a fully qualified name), or None if replicated."""
    prefix = split.layers_path + "."
    if name.startswith(prefix):
        layer = name[len(prefix) :].split(".", 1)[0]
        return plan.stage_of_layer(split.layer_names.index(layer))
    if name in split.first_direct_params or any(name.startswith(m + ".") for m in split.first_modules):
        return 0
    if name in split.last_direct_params or any(name.startswith(m + ".") for m in split.last_modules):
        return plan.num_stages - 1
    return None


@dataclass(frozen=True)
class TiedParameter:
    """One parameter used under several names (tied embeddings), on one stage or several.

    Every stage that uses it holds a copy; ``name`` (the first name in the model) is the one
    checkpoints store, whatever the layout; ``stages`` maps each name to its stage.
    """

    name: str
    stages: dict[str, int]

    @property
    def aliases(self) -> list[str]:
        return [n for n in self.stages if n != self.name]

    @property
    def owner_stage(self) -> int:
        """The stage whose copy is the reference (the one holding ``name``)."""
        return self.stages[self.name]

    @property
    def across_stages(self) -> bool:
        return len(set(self.stages.values())) > 1


def tied_parameters(module: nn.Module, split: ModelSplit, plan: StagePlan) -> list[TiedParameter]:
    """Parameters used under two or more names, in the model's order (with the stage of each name)."""
    names: dict[int, dict[str, int]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        stage = stage_of_parameter(name, split, plan)
        if stage is not None:
            names.setdefault(id(param), {})[name] = stage
    return [TiedParameter(next(iter(stages)), stages) for stages in names.values() if len(stages) > 1]


def _copy_tied_per_stage(module: nn.Module, ties: tuple[TiedParameter, ...], local: set[int]) -> None:
    """Give every local stage that uses a tied parameter its own copy (a schedule treats each stage's
    parameters on their own: one tensor in two stages would be scaled and hooked twice)."""
    for tie in ties:
        stages = sorted({s for s in tie.stages.values() if s in local})
        if len(stages) < 2:
            continue
        keep = tie.owner_stage if tie.owner_stage in stages else stages[0]
        copies: dict[int, nn.Parameter] = {}
        for name, stage in tie.stages.items():
            if stage != keep and stage in local:
                parent, leaf = _resolve(module, name)
                shared = parent._parameters[leaf]
                assert shared is not None
                if stage not in copies:
                    copies[stage] = nn.Parameter(shared.detach().clone(), requires_grad=shared.requires_grad)
                parent._parameters[leaf] = copies[stage]


def _stable_seed(base: int, fqn: str) -> int:
    return zlib.crc32(f"{base}:{fqn}".encode()) & 0x7FFFFFFF


def _initializers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules that know how to initialise their descendants (``_init_weights(sub)``, as Hugging Face models
    do), deepest first."""
    found = [(name, m) for name, m in module.named_modules() if callable(getattr(m, "_init_weights", None))]
    return sorted(found, key=lambda nm: -len(nm[0]))


def _initializer_of(sub_name: str, initializers: list[tuple[str, nn.Module]]) -> nn.Module | None:
    for name, owner in initializers:
        if not name or sub_name == name or sub_name.startswith(name + "."):
            return owner
    return None


def _materialize(module: nn.Module, fqn: str, device: torch.device, seed: int) -> None:
    """Allocate meta tensors of ``module`` on ``device`` and initialise them: by the ``_init_weights`` of the
    model that holds them when it has one (Hugging Face models: their own scheme, e.g. normal(0, 0.02)),
    else by the module's ``reset_parameters``."""
    initializers = _initializers(module)
    for sub_name, sub in module.named_modules(prefix=fqn):
        direct = [*sub._parameters.values(), *sub._buffers.values()]
        if not any(t is not None and t.is_meta for t in direct):
            continue
        owner = _initializer_of(sub_name, initializers)
        reset = getattr(sub, "reset_parameters", None) if owner is None else None
        if not callable(reset) and owner is None:
            raise ModelContractError(
                f"Module `{sub_name or type(sub).__name__}` ({type(sub).__name__}) was created on the meta device "
                f"but defines no `reset_parameters()`, so its tensors cannot be initialised on the stage that owns "
                f"it. Add a `reset_parameters()` method, or create this module outside `configure_model`."
            )
        sub.to_empty(device=device, recurse=False)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_stable_seed(seed, sub_name))
            if callable(reset):
                reset()
            else:
                assert owner is not None
                owner._init_weights(sub)  # type: ignore[operator]


def place_stages(
    module: nn.Module,
    split: ModelSplit,
    plan: StagePlan,
    *,
    pp_rank: int,
    device: torch.device,
    seed: int = 0,
    checkpointing: bool = False,
    compiler: Compiler | None = None,
    outside: Any = None,
) -> dict[int, PlacedStage]:
    """Reduce ``module`` in place to the stages on ``pp_rank`` and return what each of them owns. ``outside`` (a
    ``runtime.outside_calls.OutsideCalls``) runs calls of the model made outside steps across the pipeline's ranks.

    A module can be placed once per process; placing it again with the same plan returns the
    same stages (e.g. ``trainer.fit`` then a new Trainer's ``test``).
    """
    previous = placement_of(module)
    if previous is not None:
        if (previous.plan, previous.pp_rank) == (plan, pp_rank):
            return previous.stages
        raise ModelContractError(
            f"This {type(module).__name__} was already split into pipeline stages on this process "
            f"(cuts {previous.plan.cuts}, pipeline rank {previous.pp_rank}); the layers of the other stages are gone. "
            f"Create a new instance (and load its weights, e.g. from a checkpoint) to train it with another layout."
        )
    ties = tuple(tied_parameters(module, split, plan))
    local = plan.stages_of_rank(pp_rank)
    last = plan.num_stages - 1
    placed = {s: PlacedStage(s) for s in local}
    seq = module.get_submodule(split.layers_path)

    for index, name in enumerate(split.layer_names):
        stage = plan.stage_of_layer(index)
        fqn = split.layer_fqn(index)
        if stage in placed:
            placed[stage].modules.append(_child(seq, name))
        else:
            layer = _child(seq, name)
            like = layer.to("meta") if _all_meta(layer) else meta_copy(layer)
            seq._modules[name] = SkippedLayer(fqn, activation_parameter(own_forward(layer)), like)

    for fqns, stage, owner in ((split.first_modules, 0, "first"), (split.last_modules, last, "last")):
        for fqn in fqns:
            parent, leaf = _resolve(module, fqn)
            if stage in placed:
                placed[stage].modules.append(_child(parent, leaf))
            else:
                anywhere = fqn in split.stand_in_before
                parent._modules[leaf] = RemoteModule(
                    fqn, _child(parent, leaf), owner, anywhere=anywhere, outside=outside
                )

    loose = {0: split.first_direct_params}
    loose[last] = loose.get(last, ()) + split.last_direct_params
    for stage, fqns in loose.items():
        for fqn in fqns:
            parent, leaf = _resolve(module, fqn)
            param = parent._parameters[leaf]
            assert param is not None
            if stage in placed:
                placed[stage].params.append(param)
            else:  # (one used only after the layers stands in before them on the first stage too)
                del parent._parameters[leaf]
                owner = "first" if stage == 0 else "last"
                object.__setattr__(parent, leaf, LooseStandIn(param, fqn, owner, anywhere=stage == last))

    _materialize(module, "", device, seed)
    module.to(device)
    _copy_tied_per_stage(module, ties, set(local))
    # materialisation replaced parameter objects: collect the live ones again
    for owned in placed.values():
        if owned.params:
            live = dict(module.named_parameters())
            owned.params = [live[f] for f in loose[owned.stage]]

    for stage in local:
        rng = plan.layers_of(stage)
        for index in rng:
            instrument_layer(
                _child(seq, split.layer_names[index]),
                split.layer_fqn(index),
                stage,
                first=index == rng.start,
                last=index == rng.stop - 1,
                checkpoint=checkpointing,
                compiler=compiler,
                outside=outside,
            )
    if len(local) < plan.num_stages:
        held = ", ".join(f"{s} (layers {plan.layers_of(s).start}-{plan.layers_of(s).stop - 1})" for s in local)
        refuse_partial_saves(module, f"stage {held} of {plan.num_stages}; {split.num_layers} layers in all")
    module.__dict__[_MARK] = Placement(split, plan, pp_rank, placed, ties, outside)
    return placed
