"""Place the modules beside the layer sequence by where the step runs them, not by where ``__init__`` put them.

    split = discover(module)                                   # by registration order
    split = place_by_run(module, split, batch, fixed=("head",))  # by one cheap run of the step

:func:`~lightning_spot.partition.discovery.discover` guesses by registration order: a module registered
before the sequence goes to the first stage. Some models break that rule (OPT's decoder registers
``final_layer_norm`` before ``layers`` and runs it after them). :func:`place_by_run` runs the training step
once on one sample, without gradients and with every layer of the sequence passing its input through, and
moves each module that ran only before the first layer to the first stage and each that ran only after the
last layer to the last stage. Modules named in ``fixed`` (the user's ``first_stage_modules`` /
``last_stage_modules``) stay where they were put; modules the run does not reach keep the registration rule.
Loose parameters (set directly on the module: a class token, a logit scale) go to the first stage where their
value reaches the layers, to the last where only the code after them uses it (:func:`loose_parameter_sides`).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves, tree_map

from lightning_spot.partition.discovery import ModelSplit
from lightning_spot.partition.loss_hook import has_loss_hook, run_loss_hook
from lightning_spot.partition.stage_run import SkippedLayer, activation_parameter, meta_copy, own_forward
from lightning_spot.partition.step_checks import changed_beyond_noise, quiet_run, step_effects_kept, tensors_of

log = logging.getLogger(__name__)


@contextlib.contextmanager
def shadowed(module: nn.Module, **attributes: Any) -> Iterator[None]:
    """Instance attributes that shadow ``module``'s own (e.g. a silent ``log``), removed on the way out."""
    saved = {k: module.__dict__[k] for k in attributes if k in module.__dict__}
    module.__dict__.update(attributes)
    try:
        yield
    finally:
        for k in attributes:
            module.__dict__.pop(k, None)
        module.__dict__.update(saved)


def run_step_quietly(module: nn.Module, batch: Any, step: str = "training_step") -> Any:
    """Call the module's ``step`` (or its loss hook) on ``batch`` as Lightning would, with ``self.log`` silenced and
    the module's torchmetrics states and lists (step outputs collected for an epoch's end) left as they were."""
    silent = shadowed(module, log=lambda *a, **k: None, log_dict=lambda *a, **k: None)
    with silent, step_effects_kept(module):
        if step == "training_step" and has_loss_hook(module):
            return run_loss_hook(module, batch)
        fn = getattr(module, step)
        takes_index = len(inspect.signature(fn).parameters) > 1
        return fn(batch, 0) if takes_index else fn(batch)


@contextlib.contextmanager
def layers_passing(module: nn.Module, split: ModelSplit, meta: bool = False) -> Iterator[list[nn.Module]]:
    """Every layer of the sequence passes its input through (a :class:`SkippedLayer`) in the block; yields them.
    Their attributes are read from the layers themselves, or from meta copies (``meta``: for a copy of the module
    made in the block, which should not copy the layers' tensors)."""
    seq = module.get_submodule(split.layers_path)
    originals = dict(seq._modules)
    try:
        for index, name in enumerate(split.layer_names):
            layer = originals[name]
            assert layer is not None
            like = meta_copy(layer) if meta else layer
            seq._modules[name] = SkippedLayer(split.layer_fqn(index), activation_parameter(own_forward(layer)), like)
        yield [seq._modules[name] for name in split.layer_names]  # type: ignore[misc]
    finally:
        seq._modules.update(originals)


@contextlib.contextmanager
def _watched_runs(
    module: nn.Module, split: ModelSplit, batch: Any
) -> Iterator[Callable[[], tuple[list[Tensor], list[Tensor]]]]:
    """In the block, quiet runs of the step with the layers passing their input through: each call returns the
    tensors the first layer took (in every pass) and those of the step's result."""
    seen: list[Any] = []

    def run() -> tuple[list[Tensor], list[Tensor]]:
        seen.clear()
        result = _quiet_step(module, batch)
        return tensors_of(list(seen)), tensors_of(result)

    with layers_passing(module, split) as layers:
        watch = layers[0].register_forward_pre_hook(lambda _m, a, k: seen.append((a, k)), with_kwargs=True)
        try:
            yield run
        finally:
            watch.remove()


def _quiet_step(module: nn.Module, batch: Any) -> Any:
    with quiet_run(module, device=None):  # (no running statistics, no dropout, nothing of the run kept)
        return run_step_quietly(module, batch)


def sides_by_run(module: nn.Module, split: ModelSplit, batch: Any) -> dict[str, set[str]]:
    """Where each module beside the sequence ran in one training step whose layers pass their input through:
    a set of ``"before"`` (the first layer), ``"inside"``, ``"after"`` (the last layer) per module that ran. In a step
    that runs the sequence several times (two views of a batch), what runs before the first pass is before, what
    runs after the last pass is after, and what runs only between passes is neither."""
    passes = [0, 0]  # (begun, finished)
    calls: list[tuple[str, int, int]] = []
    handles = []

    def enter(*_: Any) -> None:
        passes[0] += 1

    def leave(*_: Any) -> None:
        passes[1] += 1

    try:
        with layers_passing(module, split) as layers:
            handles.append(layers[0].register_forward_pre_hook(enter))
            handles.append(layers[-1].register_forward_hook(leave))
            for fqn in (*split.first_modules, *split.last_modules):
                handles.append(
                    module.get_submodule(fqn).register_forward_pre_hook(
                        lambda _m, _a, fqn=fqn: calls.append((fqn, *passes))
                    )
                )
            _quiet_step(module, batch)
    finally:
        for handle in handles:
            handle.remove()
    ran: dict[str, set[str]] = {}
    for fqn, begun, finished in calls:
        if begun > finished:
            ran.setdefault(fqn, set()).add("inside")
        elif begun == 0:
            ran.setdefault(fqn, set()).add("before")
        elif finished == passes[1]:
            ran.setdefault(fqn, set()).add("after")
    return ran


def feeds_layers(module: nn.Module, split: ModelSplit, batch: Any, fqn: str) -> bool:
    """Whether what module ``fqn`` returns reaches the layer sequence's first layer: its inputs in any pass change
    when the module's output is replaced by zeros or ones (compared with runs where it is not, which also show how
    much two runs differ anyway). A module the step runs before the layers without feeding them (a teacher whose
    output only the loss uses) does not. Outputs other than floating-point tensors (token ids, say) count as
    feeding: constants of them are not told apart so simply."""
    floats = [True]

    def constant(fill: float) -> Any:
        def hook(_m: nn.Module, _a: Any, out: Any) -> Any:
            leaves = tree_leaves(out)
            floats[0] &= bool(leaves) and all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in leaves)
            return tree_map(lambda t: torch.full_like(t, fill) if isinstance(t, torch.Tensor) else t, out)

        return hook

    runs = []
    target = module.get_submodule(fqn)
    with _watched_runs(module, split, batch) as run:
        for fill in (None, 0.0, 1.0, None):  # (as it is, zeros, ones, and as it is again)
            hook = target.register_forward_hook(constant(fill)) if fill is not None else None
            try:
                runs.append(run()[0])
            finally:
                if hook is not None:
                    hook.remove()
    real, zeros, ones, again = runs
    return not floats[0] or changed_beyond_noise(real, zeros, again) or changed_beyond_noise(real, ones, again)


def loose_parameter_sides(module: nn.Module, split: ModelSplit, batch: Any, names: Sequence[str]) -> dict[str, str]:
    """Where the step uses each loose parameter in ``names`` (one set directly on the module or an ancestor of the
    sequence, read as a tensor rather than called): ``"before"`` where its value reaches the first layer's inputs (a
    position table, a class token), ``"after"`` where only the step's result depends on it (a logit scale); absent
    where neither changes. Found by runs with each parameter holding zeros and ones, with the layers passing their
    input through, compared with two runs as it is (which show how much runs differ anyway)."""
    sides: dict[str, str] = {}
    with _watched_runs(module, split, batch) as run:
        real, again = run(), run()
        for fqn in names:
            param = module.get_parameter(fqn)
            kept = param.detach().clone()
            try:
                changed = []
                for fill in (0.0, 1.0):
                    with torch.no_grad():
                        param.fill_(fill)
                    changed.append([changed_beyond_noise(r, o, a) for r, o, a in zip(real, run(), again)])
            finally:
                with torch.no_grad():
                    param.copy_(kept)
            if any(inputs for inputs, _ in changed):
                sides[fqn] = "before"
            elif any(result for _, result in changed):
                sides[fqn] = "after"
    return sides


def place_by_run(module: nn.Module, split: ModelSplit, batch: Any, fixed: Sequence[str] = ()) -> ModelSplit:
    """``split`` with the modules beside the sequence moved to the stage where the step runs them (see the
    module docstring). Returns ``split`` unchanged when the step cannot run here (e.g. modules on the meta
    device)."""
    movable = [fqn for fqn in (*split.first_modules, *split.last_modules) if fqn not in fixed]
    loose = [fqn for fqn in (*split.first_direct_params, *split.last_direct_params) if fqn not in fixed]
    if not movable and not loose:
        return split
    if any(p.is_meta for fqn in movable for p in module.get_submodule(fqn).parameters()) or any(
        module.get_parameter(fqn).is_meta for fqn in loose
    ):
        log.info("lightning-spot: modules beside the layer sequence are on the meta device; placed by registration")
        return split
    try:
        ran = sides_by_run(module, split, batch) if movable else {}
        used = loose_parameter_sides(module, split, batch, loose) if loose else {}
    except Exception as err:  # the registration rule still applies, and a misplaced module is named at run time
        log.info("lightning-spot: could not run the step to place the modules beside the layers (%s)", err)
        return split
    first, last = list(split.first_modules), list(split.last_modules)
    stand_in_before = []
    for fqn in movable:
        side = ran.get(fqn)
        if side == {"before"} and not _feeds(module, split, batch, fqn):
            if fqn in first:
                first.remove(fqn)
                last.append(fqn)
            stand_in_before.append(fqn)
            log.info(
                "lightning-spot: `%s` runs before the layer sequence, and only the code after it uses what it "
                "returns: last stage",
                fqn,
            )
        elif side == {"before"} and fqn in last:
            last.remove(fqn)
            first.append(fqn)
            log.info("lightning-spot: `%s` runs before the layer sequence: first stage", fqn)
        elif side == {"after"} and fqn in first:
            first.remove(fqn)
            last.append(fqn)
            log.info("lightning-spot: `%s` runs after the layer sequence: last stage", fqn)
    first_loose, last_loose = list(split.first_direct_params), list(split.last_direct_params)
    for fqn in loose:
        if used.get(fqn) == "after" and fqn in first_loose:
            first_loose.remove(fqn)
            last_loose.append(fqn)
            log.info("lightning-spot: only the code after the layer sequence uses parameter `%s`: last stage", fqn)
        elif used.get(fqn) == "before" and fqn in last_loose:
            last_loose.remove(fqn)
            first_loose.append(fqn)
            log.info("lightning-spot: parameter `%s` feeds the layer sequence: first stage", fqn)
    return replace(
        split,
        first_modules=tuple(first),
        last_modules=tuple(last),
        stand_in_before=tuple(stand_in_before),
        first_direct_params=tuple(first_loose),
        last_direct_params=tuple(last_loose),
    )


def _feeds(module: nn.Module, split: ModelSplit, batch: Any, fqn: str) -> bool:
    try:
        return feeds_layers(module, split, batch, fqn)
    except Exception as err:  # (where the step cannot run so, the module stays where it ran: the first stage)
        log.info("lightning-spot: could not tell whether `%s` feeds the layer sequence (%r)", fqn, err)
        return True
