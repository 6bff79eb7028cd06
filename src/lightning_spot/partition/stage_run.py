"""Run an unchanged LightningModule step function as one pipeline stage.

While a stage runs, the user's ``training_step`` (or ``validation_step`` ...) executes as usual; the
layers of the sequence consult the active :class:`StageRun` to

* take the activation received from the previous stage as the input of the stage's first layer,
* pass through (skip) layers that belong to another stage held by the same rank, and
* stop the step with :class:`StageExit` after the stage's last layer (all stages but the last).

Modules that live on other ranks are replaced by placeholders that work out their output's shape on
the meta device and hand back real tensors of that shape, filled with a constant (a *stand-in*). So
the code between the embeddings and the layer sequence (position ids, attention masks, rotary
cos/sin in Hugging Face models) computes the real values the stage's first layer needs, on the
stage's device, from the shapes alone. :func:`layer_arguments` (with :func:`check_reproducible`) shows
once per stage that those values do not depend on what the stand-ins hold. Where the replay shows that torch's
own ``nn.Sequential`` chains a stage's layers (:func:`sequential_caller`) in the state the stage started in
(:func:`ambient_state`), a stage between the first and the last calls only them for the step's later micro-batches:
nothing of the user's code before the sequence counts there.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import types
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_leaves, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from lightning_spot.partition.discovery import ModelContractError
from lightning_spot.replay.draws import draw_key, reseed


class StageExit(BaseException):
    """Raised after a stage's last layer to end the user's step function early (not an error).

    A ``BaseException`` so that a user's ``except Exception`` cannot swallow it.
    """

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output


class StageProbe(BaseException):
    """Raised at a stage's first layer when probing: carries what the layer was called with (not an error)."""

    def __init__(self, layer: str, arguments: dict[str, Any]) -> None:
        super().__init__()
        self.layer = layer
        self.arguments = arguments


@dataclass
class StageRun:
    """What the stage currently executing on this rank needs."""

    stage: int
    first_stage: bool
    incoming: tuple[torch.Tensor, ...] | None
    exit_after: bool
    layers_started: bool = False
    meta_args: list[str] = field(default_factory=list)
    #: where stand-ins for modules of other stages are made, and the value they hold (None: meta tensors)
    device: torch.device | None = None
    stand_in: float = 0.0
    #: stop at the stage's first layer with a :class:`StageProbe` of its arguments
    probe: bool = False
    #: note in :attr:`chained` the stage's layers if torch's own ``nn.Sequential.forward`` calls its first layer
    #: (:func:`sequential_caller`; ``None``: the user's code does)
    find_chain: bool = False
    chained: list[nn.Module] | None = None
    #: (find_chain) :func:`ambient_state` where the stage started: the layers are chained alone only if the step's
    #: code calls the first one in the same state (no autocast, grad mode or torch mode of the user's around them)
    ambient: tuple | None = None
    #: (probes) what the last layer passed through (of another stage) returned, and its name: the stage's first layer
    #: must be called with it unchanged (:func:`check_unchanged_between`)
    passed: Any = None
    passed_by: str = ""
    #: where the step's own random draws are seeded alike on every stage: the seed of the stage's layers' draws
    #: (dropout), taken up at its first layer, so that those differ between stages (``replay.draws.reseed``), and the
    #: seed the step's code draws from between two passes (the same on every stage)
    layer_seed: int | None = None
    pass_seed: int | None = None
    #: how many times the step runs the layer sequence (a step that calls the model on two views of its batch): a
    #: stage sends the outputs of all its passes at once and takes pass ``i``'s input from the ``i``-th part of
    #: ``incoming``; the passes begun so far, and the outputs of those finished
    passes: int = 1
    passes_begun: int = 0
    outputs: list[Any] = field(default_factory=list)
    #: only count the passes (``step_checks.count_passes``): every layer passes on a constant (``pass_fill``), and
    #: modules of other stages stand in wherever they run; the layer counted (the first one called)
    counting: bool = False
    #: a training step's run, whose backward follows (not a check, an evaluation or torch's shape inference)
    training: bool = False
    #: how often each block held at several places of the sequence was called in this run
    calls: dict[int, int] = field(default_factory=dict)
    counted_layer: str = ""
    pass_fill: float = 0.0
    #: (``step_checks.stand_ins_used``) the value each module's stand-in holds, by name (others: ``stand_in``), and
    #: the modules that stood in
    stand_in_for: dict[str, float] | None = None
    stood_in: list[str] | None = None


_ACTIVE: list[StageRun] = []

#: ``torch.compile`` as the user called it (its backend and options): compiles a function
Compiler = Callable[[Callable[..., Any]], Callable[..., Any]]


def active_run() -> StageRun | None:
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def running(run: StageRun) -> Iterator[StageRun]:
    _ACTIVE.append(run)
    try:
        yield run
    finally:
        _ACTIVE.pop()


def incoming_value(incoming: tuple[torch.Tensor, ...]) -> Any:
    return incoming[0] if len(incoming) == 1 else incoming


def pass_input(run: StageRun, index: int, fqn: str) -> Any:
    """What the stage's first layer ``fqn`` takes in pass ``index`` of the step: the previous stage's output of that
    pass (the ``index``-th of ``run.passes`` equal parts of what it sent)."""
    assert run.incoming is not None
    if index >= run.passes:
        raise ModelContractError(
            f"The step ran the layer sequence (layer `{fqn}`) more often than the {run.passes} time(s) counted at its "
            f"first step. The stages of a pipeline send every pass's activations at once, so each step must call "
            f"the layers the same number of times."
        )
    size = len(run.incoming) // run.passes
    return incoming_value(run.incoming[index * size : (index + 1) * size])


def end_pass(run: StageRun, out: Any) -> Any:
    """After the stage's last layer: note the pass's output; after the last pass, leave the step (all stages but
    the last) with every pass's output. Where the step goes on, what its code draws comes from a seed of the pass,
    the same on every stage (the stages' layers drew from seeds of their own)."""
    run.outputs.append(out)
    if run.exit_after and len(run.outputs) >= run.passes:
        raise StageExit(tuple(run.outputs) if run.passes > 1 else out)
    if run.pass_seed is not None:
        reseed(draw_key(run.pass_seed, run.passes_begun), run.device)
    return out


def between_passes(run: StageRun) -> bool:
    """Whether the step is between two passes of the stage's layers (or, but on the first stage, before the first):
    modules of other stages beside the layers stand in there, as they do before the layers on later stages."""
    done = len(run.outputs)
    return done == run.passes_begun and done < run.passes and (done > 0 or not run.first_stage)


def _named_arguments(args: tuple, kwargs: dict) -> dict[str, Any]:
    """The arguments of a layer call beside the activation, each under a readable name."""
    named = {f"positional argument {i + 2}": a for i, a in enumerate(args)}
    named.update(kwargs)
    return named


def _leaves(named: dict[str, Any]) -> list[tuple[str, Any]]:
    out = []
    for path, leaf in tree_flatten_with_path(named)[0]:
        out.append((keystr(path).strip("[]'\""), leaf))
    return out


def _reject_meta(fqn: str, named: dict[str, Any]) -> None:
    if not named or not any(isinstance(leaf, torch.Tensor) and leaf.is_meta for leaf in tree_leaves(named)):
        return  # (every call of a stage's first layer: the names are only worked out for the error)
    meta = next(name for name, leaf in _leaves(named) if isinstance(leaf, torch.Tensor) and leaf.is_meta)
    raise ModelContractError(
        f"Layer `{fqn}` received `{meta}` computed by modules that live on another pipeline stage (it only "
        f"exists as a shape here). Compute it inside the layers or from the raw batch, or keep the modules it "
        f"comes from on every stage."
    )


def hidden_argument(args: tuple, kwargs: dict[str, Any], activation: str | None) -> Any:
    """The hidden state a layer is called with: its first positional argument, or the one named ``activation``."""
    if args:
        return args[0]
    return kwargs.get(activation) if activation else None


def _note_passed(value: Any, fqn: str) -> Any:
    """A layer of another stage passes ``value`` through: note it when probing (see :func:`check_unchanged_between`);
    when counting passes (``step_checks.count_passes``), note the first layer's input and pass on a constant."""
    if not _ACTIVE:
        return value
    run = _ACTIVE[-1]
    if run.probe:
        run.passed, run.passed_by = value, fqn
    elif run.counting:
        run.counted_layer = run.counted_layer or fqn
        if fqn == run.counted_layer:
            run.passes_begun += 1
            run.outputs.append(tree_map(_copied, value))
        return tree_map(lambda t: _filled(t, run.pass_fill), value)
    return value


def _copied(t: Any) -> Any:
    return t.clone() if isinstance(t, torch.Tensor) else t


def _filled(t: Any, value: float) -> Any:
    return torch.full_like(t, value) if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def _same_values(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
            return False
        return a.is_meta or bool(torch.equal(a, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(x is y or _same_values(x, y) for x, y in zip(a, b))
    return False


def check_unchanged_between(run: StageRun, fqn: str, hidden: Any) -> None:
    """Raise if the step's code changed the hidden state between the layer before the stage (passed through here)
    and the stage's first layer ``fqn``: at a stage boundary that code is not applied (the stage before sends its last
    layer's output as it is), so the pipeline would train something else than one process does."""
    before, passed = run.passed_by, run.passed
    if not before or hidden is passed or _same_values(hidden, passed):
        return
    if isinstance(passed, torch.Tensor) and passed.dim() > 0 and _same_values(hidden, passed[0]):
        return  # a layer that returns a tuple, whose first element the step takes (Falcon, Bloom): passed through
        # here, the hidden state itself is returned and `[0]` takes its first row, which the first layer replaces
    raise ModelContractError(
        f"The step's code changes the hidden state between layer `{before}` and layer `{fqn}` (something like "
        f"`x = layer(x) * scale`, a residual, a norm or a dropout between the layers, or a forward pre-hook on "
        f"`{fqn}` that changes its input), and a pipeline stage boundary "
        f"falls there: `{before}`'s stage sends its output as it is and `{fqn}` (the first layer of stage "
        f"{run.stage}) takes it, so that code would be skipped and training would differ from one process. Move the "
        f"code into the layers (one module per layer and what follows it), or cut elsewhere with "
        f"`SpotPipelineStrategy(partition=[...])`."
    )


def check_reproducible(fqn: str, first: dict[str, Any], second: dict[str, Any]) -> None:
    """Raise if the arguments of a stage's first layer differ between two stand-in values: then they depend on
    what modules of other stages computed, not only on shapes, and cannot be rebuilt on this stage."""
    for (name, a), (_, b) in zip(_leaves(first), _leaves(second)):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            same = a.shape == b.shape and torch.equal(a, b)
        elif isinstance(a, (int, float, bool, str, type(None))):
            same = type(a) is type(b) and a == b
        else:  # objects made on this stage (a key-value cache, say): the same kind is what matters
            same = type(a) is type(b)
        if not same:
            raise ModelContractError(
                f"Layer `{fqn}`, the first of its pipeline stage, receives `{name}`, which is computed from the "
                f"values of modules that run on an earlier stage (embeddings), so this stage cannot rebuild it. "
                f"Only the hidden state travels between stages: compute `{name}` from the raw batch or inside the "
                f"layers, or pass it through the layers as part of their output."
            )


def refuse_collective_in_step(collective: str) -> None:
    """A collective (``self.all_gather``, the strategy's ``reduce``/``broadcast``/``barrier``) called while a stage
    runs the user's step: the stages run the step only up to their layers, or from them on, so the other ranks never
    reach it and every rank would wait until the step timeout. Stop at once, naming where to do it instead."""
    if active_run() is None:
        return
    raise ModelContractError(
        f"{collective} was called inside a step function under spot_pipeline. Each pipeline stage runs the step only "
        f"up to its layers (the last stage from its layers on), so the other ranks never reach it and the job would "
        f"wait until the step timeout. Gather or reduce in a hook that every rank runs (`on_validation_epoch_end`, "
        f"`on_train_batch_end`): the step's returned outputs and its `self.log` values reach every rank."
    )


#: what a stage's first layer was fed instead of the hidden state its caller gave (the previous stage's output), by
#: the given tensor: a recomputation of the call (the user's ``torch.utils.checkpoint`` around the layer, in the
#: backward, after the run) must compute from the same input
_FED_INSTEAD: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _in_reentrant_checkpoint() -> bool:
    """Whether the caller runs inside ``torch.utils.checkpoint``'s reentrant forward (a few frames up)."""
    code = torch.utils.checkpoint.CheckpointFunction.forward.__code__
    frame: types.FrameType | None = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            return False
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _reentrant_checkpoint(fqn: str) -> ModelContractError:
    return ModelContractError(
        f"Layer `{fqn}` runs inside `torch.utils.checkpoint.checkpoint(..., use_reentrant=True)` in a training step, "
        f"next to another pipeline stage. That checkpoint connects gradients to its own arguments and outputs only, "
        f"but this layer takes the previous stage's output, or hands its own on, around them: the stages before "
        f"would not train. Use "
        f"`use_reentrant=False` (torch's recommendation), or let the strategy recompute the layers: "
        f"`SpotPipelineStrategy(activation_checkpointing=True)`."
    )


def _fed(fqn: str, args: tuple, kwargs: dict[str, Any], activation: str | None, value: Any) -> tuple[tuple, dict]:
    """A layer's arguments with ``value`` as its hidden state."""
    if args:
        return (value, *args[1:]), kwargs
    if activation is not None and activation in kwargs:
        return args, {**kwargs, activation: value}
    raise ModelContractError(
        f"Layer `{fqn}` was called without its input (`{activation}`); the layer sequence must pass "
        f"the hidden state to each layer, positionally or by that name."
    )


def own_forward(layer: nn.Module) -> Callable[..., Any]:
    """The ``forward`` of the layer's class; for a block compiled by the user (``torch.compile(block)``, whose
    module class defines none), that of the module it wraps."""
    inner: nn.Module = getattr(layer, "_orig_mod", layer)
    return type(inner).forward


def _unbound(call: Callable[..., Any]) -> Callable[..., Any]:
    return lambda _self, *args, **kwargs: call(*args, **kwargs)


def instrument_layer(
    layer: nn.Module,
    fqn: str,
    stage: int,
    *,
    first: bool,
    last: bool,
    checkpoint: bool = False,
    compiler: Compiler | None = None,
    outside: Any = None,
) -> None:
    """Make an owned layer obey the active :class:`StageRun` (an instance-level ``forward`` override).

    Overriding ``forward`` on the instance keeps parameter names and ``state_dict`` keys unchanged.
    With ``checkpoint``, the layer's activations are recomputed in backward instead of kept; with ``compiler``
    (``torch.compile``'s, see :mod:`lightning_spot.runtime.compiled`) the layer's own ``forward`` is compiled.
    ``outside`` (a :class:`~lightning_spot.runtime.outside_calls.OutsideCalls`) runs calls made outside steps across the
    pipeline's ranks.
    """
    positions: list[tuple[str, int, bool, bool]] | None = layer.__dict__.get("_spot_positions")
    if positions is not None:  # the same block at another place of the sequence (blocks shared ALBERT-style)
        positions.append((fqn, stage, first, last))
        return
    positions = layer.__dict__["_spot_positions"] = [(fqn, stage, first, last)]
    original = own_forward(layer)
    activation = activation_parameter(original)
    compiled = layer.__dict__.get("forward")  # (a block the user compiled: torch.compile's module holds its forward)
    if compiled is not None:
        original = _unbound(compiled)
    elif compiler is not None:
        original = compiler(original)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        run = active_run()
        if run is None:  # (outside steps, or torch.utils.checkpoint recomputing a call made in one)
            given = hidden_argument(args, kwargs, activation)
            value = _FED_INSTEAD.get(given) if isinstance(given, torch.Tensor) else None
            if value is not None:
                args, kwargs = _fed(positions[0][0], args, kwargs, activation, value)
            elif outside is not None and outside_call():
                if len(positions) > 1:
                    raise ModelContractError(
                        f"Block `{positions[0][0]}` sits at several places of the sequence; calls of the model "
                        f"outside a step (in a hook, after fit) are not supported for such models in a pipeline."
                    )
                return outside.layer_call(self, original, positions[0], args, kwargs, activation)
            return original(self, *args, **kwargs)
        if len(positions) == 1:
            fqn, stage, first, last = positions[0]
        else:  # (called at its places in order: the k-th call of a run is at its k-th place)
            count = run.calls[id(self)] = run.calls.get(id(self), -1) + 1
            fqn, stage, first, last = positions[count % len(positions)]
        if run.stage != stage:
            return _note_passed(hidden_argument(args, kwargs, activation), fqn)
        boundary = (first and run.incoming is not None) or (last and run.exit_after)  # (next to another stage)
        if boundary and run.training and not torch.is_grad_enabled() and _in_reentrant_checkpoint():
            raise _reentrant_checkpoint(fqn)
        if first:
            run.layers_started = True
            begun, run.passes_begun = run.passes_begun, run.passes_begun + 1
            if run.layer_seed is not None:
                reseed(draw_key(run.layer_seed, begun) if begun else run.layer_seed, run.device)
            if run.find_chain and run.passes == 1 and ambient_state(run.device) == run.ambient:
                run.chained = sequential_caller(self)
            named = None  # (the arguments besides the activation: for probes, and on stages but the first)
            if run.probe or not run.first_stage:
                named = _named_arguments(args[1:], {k: v for k, v in kwargs.items() if k != activation or args})
            if run.probe:
                check_unchanged_between(run, fqn, hidden_argument(args, kwargs, activation))
                raise StageProbe(fqn, named or {})
            if run.incoming is not None:
                value = pass_input(run, begun, fqn) if run.passes > 1 else incoming_value(run.incoming)
                given = hidden_argument(args, kwargs, activation)
                args, kwargs = _fed(fqn, args, kwargs, activation, value)
                if isinstance(given, torch.Tensor) and given is not value:  # (for a recomputation of this call: the
                    _FED_INSTEAD[given] = value  # user's checkpoint; a key that is its own value would never go)
            if named:
                _reject_meta(fqn, named)
        if checkpoint and torch.is_grad_enabled():
            out = torch.utils.checkpoint.checkpoint(original, self, *args, use_reentrant=False, **kwargs)
        else:
            out = original(self, *args, **kwargs)
        if last:
            return end_pass(run, out)
        return out

    layer.forward = types.MethodType(forward, layer)
    _INSTRUMENTED[layer] = stage


#: the layers :func:`instrument_layer` made obey the active run, and their stages
_INSTRUMENTED: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
#: the frames of ``nn.Module.__call__`` between a module's caller and its ``forward``
_CALL_FRAMES = frozenset({nn.Module._call_impl.__code__, nn.Module._wrapped_call_impl.__code__})


def sequential_caller(layer: nn.Module) -> list[nn.Module] | None:
    """The layers of ``layer``'s stage (``layer`` is its first), when the ``nn.Sequential`` holding them is calling
    ``layer`` right now with its own, unchanged ``forward``, and everything it runs before is a layer of the
    sequence too (of other stages: passed through).

    Then torch's code alone chains the stage's layers, each taking the previous one's output: calling them in
    turn with the run active does what a replay of the user's step does on a stage that is neither the first nor
    the last (:meth:`StepRunner.stage_forward`), without the user's code before the sequence."""
    frame: types.FrameType | None = sys._getframe(2)  # (0: here, 1: the layer's forward)
    while frame is not None and frame.f_code in _CALL_FRAMES:
        frame = frame.f_back
    if frame is None or frame.f_code is not nn.Sequential.forward.__code__:
        return None
    container = frame.f_locals.get("self")
    if type(container) is not nn.Sequential:
        return None
    children = list(container._modules.values())
    for i, child in enumerate(children):
        if child is layer:
            stage = _INSTRUMENTED[layer]
            return [c for c in children[i:] if _INSTRUMENTED.get(c) == stage]  # (a stage's layers are consecutive)
        if not isinstance(child, SkippedLayer) and child not in _INSTRUMENTED:
            return None
    return None


def ambient_state(device: torch.device | None) -> tuple:
    """What code around a layer call can switch that changes what the layer computes: grad and inference mode,
    autocast (on the CPU and on ``device``'s type) and its dtype, and how many torch function and dispatch modes are
    active. The layers of a stage run alone (:func:`sequential_caller`) only where the step's code calls them in the
    state the stage started in, since running them alone leaves that code out."""
    kinds = sorted({"cpu", device.type if device is not None else "cpu"})
    autocast = tuple((kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) for kind in kinds)
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        autocast,
        torch._C._len_torch_function_stack(),
        torch._C._len_torch_dispatch_stack(),
    )


def activation_parameter(forward: Any) -> str | None:
    """The name of a layer's first input (the hidden state), for layers called by keyword."""
    try:
        params = [p for p in inspect.signature(forward).parameters.values() if p.name != "self"]
    except (TypeError, ValueError):
        return None
    first = params[0] if params else None
    return first.name if first is not None and first.kind in (first.POSITIONAL_OR_KEYWORD, first.KEYWORD_ONLY) else None


class SkippedLayer(nn.Module):
    """Stands in for a layer that another pipeline stage owns; passes its first input through."""

    def __init__(self, fqn: str, activation: str | None = None, like: nn.Module | None = None) -> None:
        super().__init__()
        self.fqn = fqn
        self.activation = activation
        #: (outside the module tree) the layer, or a meta copy of it, whose attributes the model's code may read
        #: (``nn.TransformerEncoder`` reads its first layer's ``self_attn.batch_first``)
        object.__setattr__(self, "_like", like)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _note_passed(hidden_argument(args, kwargs, self.activation), self.fqn)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            like = self.__dict__.get("_like")
            if like is None:
                raise
            return getattr(like, name)

    def extra_repr(self) -> str:
        return f"on another stage: {self.fqn}"


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to("meta") if not value.is_meta else value
    if isinstance(value, (list, tuple)):
        return type(value)(_to_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_meta(v) for k, v in value.items()}
    return value


#: whether stand-ins called outside a step give zeros where their input is (:func:`shapes_only`)
_SHAPES_ONLY = False
#: whether calls of the model outside steps run across the pipeline (:mod:`lightning_spot.runtime.outside_calls`)
_OUTSIDE_CALLS = False


def run_outside_calls() -> None:
    """From now on, stand-ins called outside a step give zeros where their input is (calls of the model outside
    steps run across the pipeline's ranks, each its own layers: :mod:`lightning_spot.runtime.outside_calls`)."""
    global _OUTSIDE_CALLS
    _OUTSIDE_CALLS = True


def outside_call() -> bool:
    """Whether the model is being called outside a step (in a hook, after fit), not reading shapes only, and not in
    a backward (which recomputes calls made in a step)."""
    return _OUTSIDE_CALLS and not _ACTIVE and not _SHAPES_ONLY and torch._C._current_autograd_node() is None


@contextlib.contextmanager
def shapes_only() -> Iterator[None]:
    """Outside a step, stand-ins for other stages' modules give zeros of their outputs' shapes on their input's
    device (not meta tensors), so that a forward that only reads shapes (Lightning's model summary of
    ``example_input_array``) runs through this rank's modules."""
    global _SHAPES_ONLY
    before, _SHAPES_ONLY = _SHAPES_ONLY, True
    try:
        yield
    finally:
        _SHAPES_ONLY = before


def _device_of(value: Any) -> torch.device | None:
    """The device of the first tensor in ``value`` that is not on the meta device."""
    return next((t.device for t in tree_leaves(value) if isinstance(t, torch.Tensor) and not t.is_meta), None)


def stand_in_fill(
    fqn: str, owner: str, anywhere: bool, inputs: Any, kind: str = "Module"
) -> tuple[torch.device | None, float]:
    """Where and with which value the stand-in for ``fqn`` (a module or loose parameter of the ``owner`` stage)
    gives what it computes: in a step, the run's device and stand-in value (the step's code before the layers runs on
    every stage and is thrown away on the later ones); outside one, the meta device (None), or zeros on the device of
    ``inputs`` in a forward that reads shapes only. Raises where the step uses it on a stage that needs its real value
    (the first stage, or after the layers), unless it stands in ``anywhere``."""
    run = active_run()
    if run is None:
        if owner == "last" and not anywhere and outside_call():
            raise ModelContractError(
                f"{kind} `{fqn}` of the last stage is used in a call of the model outside a step (in a hook, after "
                f"fit) on a stage that does not hold it: such calls give the last stage's module outputs to every "
                f"rank, not its {kind.lower()}s. Use it inside a module of the last stage (or in a step)."
            )
        return (_device_of(inputs) if _SHAPES_ONLY or _OUTSIDE_CALLS else None), 0.0
    misplaced = (run.first_stage or run.layers_started) and not anywhere
    if misplaced and not run.counting and not between_passes(run):
        raise misplaced_module(fqn, owner, run, kind)
    value = run.stand_in
    if run.stood_in is not None:
        run.stood_in.append(fqn)
        value = (run.stand_in_for or {}).get(fqn, value)
    return run.device, value


class RemoteModule(nn.Module):
    """Stands in for a module that lives on another pipeline stage; computes shapes on the meta device.

    It holds a parameter-free meta copy of the original, outside the module tree, so it adds
    nothing to ``parameters()`` or ``state_dict()``.
    """

    def __init__(self, fqn: str, original: nn.Module, owner: str, anywhere: bool = False, outside: Any = None) -> None:
        super().__init__()
        self.fqn = fqn
        self.owner = owner
        #: stands in wherever it runs (a module of the last stage whose output the layers do not take)
        self.anywhere = anywhere
        meta = original.to("meta") if _all_meta(original) else meta_copy(original)
        object.__setattr__(self, "_meta_module", meta)
        #: (a module of the last stage) gives its real output in calls outside steps (``runtime/outside_calls.py``)
        object.__setattr__(self, "_outside", outside)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        outside = self.__dict__.get("_outside")
        if outside is not None and self.owner == "last" and outside_call():
            return outside.last_output(self._meta_module(*_to_meta(args), **_to_meta(kwargs)))
        device, value = stand_in_fill(self.fqn, self.owner, self.anywhere, (args, kwargs))
        out = self._meta_module(*_to_meta(args), **_to_meta(kwargs))
        if device is None:
            return out
        return tree_map(
            lambda t: (
                torch.full(t.shape, value, dtype=t.dtype, device=device)
                if isinstance(t, torch.Tensor) and t.is_meta
                else t
            ),
            out,
        )

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_meta_module"), name)

    def extra_repr(self) -> str:
        return f"on the {self.owner} stage: {self.fqn}"


def misplaced_module(fqn: str, owner: str, run: StageRun, kind: str = "Module") -> ModelContractError:
    """The error for a module (or loose parameter: ``kind``) of the ``owner`` stage that the step runs on ``run``'s
    stage, where it cannot stand in."""
    here = "the first stage" if run.first_stage else f"stage {run.stage}, after the layer sequence"
    side = "first_stage_modules" if run.first_stage else "last_stage_modules"
    again = ""
    if run.outputs and not run.first_stage:
        again = (
            f" If the step calls the model again here, every step must run the layer sequence as many times as its "
            f"first step did ({run.passes}, counted there): the stages of a pipeline send all passes at once."
        )
    if kind == "Module":
        rule = (
            "by registration order: before the sequence in __init__ means the first stage, after it the last. Pass "
            f"`SpotPipelineStrategy({side}=['{fqn}'])`, or register it on the right side of the sequence."
        )
        verb = "runs"
    else:
        rule = (
            f"on the first stage. Pass `SpotPipelineStrategy({side}=['{fqn}'])`. A parameter that both the code before "
            f"the layers and the code after them use cannot go to one stage: set it on a small module, and use two "
            f"instances of it that share the parameter, one on each side (held as a copy per stage, kept equal, as "
            f"tied embeddings are)."
        )
        verb = "is used"
    return ModelContractError(
        f"{kind} `{fqn}` was placed on the {owner} stage but {verb} on {here}.{again} Modules and parameters beside "
        f"the layer sequence go where one run of the training step on a training batch uses them; without one "
        f"(validate/test/predict only, or modules built on the meta device) {rule}"
    )


def _all_meta(module: nn.Module) -> bool:
    return all(t.is_meta for t in (*module.parameters(), *module.buffers()))


def meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose parameters and buffers are meta tensors (allocates nothing)."""
    import copy

    memo: dict[int, Any] = {}
    for t in (*module.parameters(), *module.buffers()):
        meta = torch.empty_like(t, device="meta")
        if isinstance(t, nn.Parameter):
            meta = nn.Parameter(meta, requires_grad=t.requires_grad)
        memo[id(t)] = meta
    return copy.deepcopy(module, memo)
