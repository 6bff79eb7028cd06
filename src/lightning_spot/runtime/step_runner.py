"""Run the user's step function for one stage and one micro-batch.

    runner = StepRunner(module, num_stages=4, capture=LogCapture())
    with runner.bind("training_step", "train", batch, args, kwargs):
        outputs = runner.stage_forward(stage, (activation,))       # stages but the first and last
        loss = runner.loss_fn(outputs, sample_indices)             # the last stage

A stage's input is the micro-batch's sample indices (first stage) or the previous stage's
activations (the rows they stand for follow from the micro-batch's index, :attr:`StepRunner.chunk`,
so that only activations travel between stages); its forward replays the user's step function up to the end of the
stage's layers (see ``partition.stage_run``). On the last stage, the schedule's ``loss_fn`` replays
the whole step function from the received activation on, so ``self.log`` and the loss come from
unchanged user code. A stage between the first and the last whose layers a replay showed chained by torch's
``nn.Sequential`` calls only those layers afterwards.
"""

from __future__ import annotations

import contextlib
import warnings
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.amp import GradScaler
from torch.utils._pytree import tree_flatten, tree_map

from lightning_spot.partition.discovery import ModelContractError
from lightning_spot.partition.loss_hook import has_loss_hook, run_loss_hook
from lightning_spot.partition.stage_run import (
    StageExit,
    StageProbe,
    StageRun,
    ambient_state,
    check_reproducible,
    incoming_value,
    running,
)
from lightning_spot.partition.step_checks import count_passes, refuse_stand_ins_used, stand_ins_used, step_effects_kept
from lightning_spot.replay.draws import draw_key, python_drew, python_states, reseed, seeded_draws
from lightning_spot.replay.module_lists import lists_kept
from lightning_spot.replay.pytree import register_containers
from lightning_spot.runtime.clock import StepClock
from lightning_spot.runtime.item_counts import LOSS_REDUCTION, NUM_ITEMS, ItemCounts, either
from lightning_spot.runtime.logging_bridge import LogCapture
from lightning_spot.runtime.loss_weights import LossWeights
from lightning_spot.runtime.metric_bridge import MetricCalls, detached
from lightning_spot.runtime.offload import ActivationOffload
from lightning_spot.runtime.summed_losses import SummedLosses
from lightning_spot.runtime.weight_streaming import WeightStreaming

Mode = Literal["train", "eval", "predict"]

#: the steps of each step function during which losses are watched for means over ignored targets (training, for
#: the warning) and sums over samples
WATCHED_STEPS = 8
#: the name under which the last stage tells, with a step's logged values, that the step returned outputs besides
#: its loss (``StepRunner.step_outputs``), which every rank of the pipeline then receives
STEP_OUTPUTS = "__outputs__"
#: in the seeds of what hooks draw (:meth:`StepRunner.seed_hooks`): apart from the steps' and the data's
_HOOKS = 0x4B
#: the name under which the last stages tell, with a step's logged values, that a step set ``trainer.should_stop``
#: (after its forward, which only the last stage reaches): summed over replicas, every rank then stops
SHOULD_STOP = "__should_stop__"


UNWEIGHTED_MEAN = (
    "spot_pipeline: training_step returned a loss averaged over targets that hold an ignore_index (e.g. labels of "
    "-100 on padding or prompt tokens), so the micro-batches of a step hold different numbers of real items, but "
    "the step did not say how many: each micro-batch's mean counts the same, which differs from the mean over the "
    "global batch that single-process training computes. Return the count with the loss, e.g. "
    "`return {'loss': loss, 'num_items': (labels != -100).sum()}` (plain Lightning ignores the extra key); see "
    "docs/model-contract.md, 'Losses averaged over tokens'."
)


def batch_size_of(batch: Any) -> int:
    register_containers(batch)  # (a tokenizer's BatchEncoding, a dataclass: walked like a dict from now on)
    leaves, _ = tree_flatten(batch)
    for leaf in leaves:
        if isinstance(leaf, Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise ModelContractError("spot_pipeline could not find a tensor in the batch to split into micro-batches.")


def batch_signature(batch: Any) -> tuple:
    leaves, spec = tree_flatten(batch)
    return (str(spec), tuple((tuple(t.shape), t.dtype) for t in leaves if isinstance(t, Tensor)))


def _map_leaves(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree_map(fn, tree)``, with plain tuples, lists and dicts (the batches most loaders give) walked here:
    pytree's general machinery costs more than the rest of taking a micro-batch's rows."""
    kind = type(tree)
    if kind is tuple or kind is list:
        return kind(_map_leaves(fn, item) for item in tree)
    if kind is dict:
        return {key: _map_leaves(fn, value) for key, value in tree.items()}
    if isinstance(tree, Tensor):
        return fn(tree)
    return tree_map(fn, tree)


def _as_tensors(out: Any, where: str) -> tuple[Tensor, ...]:
    items = out if isinstance(out, (tuple, list)) else (out,)
    if not items or not all(isinstance(t, Tensor) for t in items):
        raise ModelContractError(
            f"{where} returned {type(out).__name__}; layers in the sequence must return a tensor or a tuple of "
            f"tensors so that the output can be sent to the next pipeline stage."
        )
    return tuple(items)


class StepRunner:
    """Runs the user's step function for one stage and one micro-batch (shared by all local stages)."""

    def __init__(
        self, module: nn.Module, num_stages: int, capture: LogCapture, device: torch.device | None = None
    ) -> None:
        self.module = module
        self.device = device
        #: (stage, step function) pairs whose first-layer arguments were shown to be rebuildable here
        self._checked: set[tuple[int, str]] = set()
        self.last_stage = num_stages - 1
        self.capture = capture
        self.fn_name = "training_step"
        self.mode: Mode = "train"
        self.batch: Any = None
        self.local_size = 0
        self.step_args: tuple = ()
        self.step_kwargs: dict[str, Any] = {}
        self.results: list[tuple[Tensor, Any]] = []
        #: (the last stage) what each micro-batch's step returned besides its loss and item count (training), or
        #: whatever it returned (validation, test), detached: Lightning's ``outputs`` of the step's batch hooks
        self.step_outputs: list[Any] = []
        self._inferring = 0
        self._losses_computed = 0
        self.clock = StepClock()
        #: saved activations go to host memory during training forwards (``offload="activations"``)
        self.activation_offload: ActivationOffload | None = None
        #: stages' weights on the device only while they compute (``offload="parameters"``)
        self.weights: WeightStreaming | None = None
        #: called with a stage's index once its gradients of the step are final (after its last backward)
        self.grads_final: list[Callable[[int], None]] = []
        #: what each micro-batch's loss is a mean over, and how the step's losses combine
        self.items = ItemCounts(module, stages=num_stages)
        self.loss_weights = LossWeights()
        #: which losses and logged values are sums over samples
        self.sums = SummedLosses()
        #: the step's calls of the module's torchmetrics metrics (set up by the engine, which knows the groups)
        self.metric_calls: MetricCalls | None = None
        #: fp16 (``precision="16-mixed"``): the gradient scaler every rank agrees with (runtime/loss_scale.py), and
        #: the step's micro-batches over all replicas, which each scaled loss is divided by in the backward
        self.scaler: GradScaler | None = None
        self.scale_divisor = 1
        #: the steps run of each step function (the first are watched)
        self._steps: dict[str, int] = {}
        self._warned_unweighted = False
        #: (watched steps) whether a loss given without an item count was a mean over targets holding an ignore
        #: index: a flag on the device, read once after the step (:meth:`warn_unweighted`), not per micro-batch
        self._ignored: Tensor | None = None
        #: what the user's step draws at random (noise, masks) is seeded alike on every stage of the pipeline from
        #: this seed, the step and micro-batch, and the replica (``None``: not seeded); see :meth:`_draws`
        self.draw_seed: int | None = None
        self.dp_rank = 0
        self._draw_step = 0
        self._hooks_seeded = 0
        #: the step functions seen drawing from Python's ``random`` or NumPy in their first steps (seeded too)
        self._python_draws: set[str] = set()
        #: the micro-batch the stage about to run works on (set by the stage), and the step's micro-batches
        self.chunk = 0
        self.microbatches = 1
        self._rows_cache: dict[tuple[int, int], tuple[Tensor, ...]] = {}
        #: (stage, step function) -> the stage's layers, where the step's first replay showed that torch's
        #: ``nn.Sequential`` chains them in the state the stage started in (None: the user's code does, or runs them
        #: under a context of its own, and the step is replayed); only stages between the first and the last
        self._chains: dict[tuple[int, str], list[nn.Module] | None] = {}
        #: how many times each step function runs the layer sequence (counted at its first step; see _passes_of)
        self._passes: dict[str, int] = {}
        #: (the last stage) the step functions whose result was shown not to depend on stand-ins (_check_result)
        self._results_checked: set[str] = set()

    @property
    def divides_losses(self) -> bool:
        """Whether each training micro-batch's loss is divided here by the step's micro-batch count, so that the
        gradients the backward accumulates are already their mean (torch's ``scale_grads`` would divide every
        gradient afterwards: a pass over the weights on the critical path). Not with fp16, whose backward keeps the
        values of one process (the same overflows): there the schedule divides the gradients."""
        return self.scaler is None

    @contextlib.contextmanager
    def inferring(self) -> Iterator[None]:
        """torch's shape inference runs a throw-away forward: mark it so no user-visible effects happen."""
        self._inferring += 1
        try:
            yield
        finally:
            self._inferring -= 1

    @contextlib.contextmanager
    def bind(
        self, fn_name: str, mode: Mode, batch: Any, args: tuple, kwargs: dict[str, Any], microbatches: int = 1
    ) -> Iterator[None]:
        self.fn_name, self.mode, self.batch, self.microbatches = fn_name, mode, batch, microbatches
        if self.activation_offload is not None and mode == "train":
            self.activation_offload.new_step()
        self.local_size = batch_size_of(batch)
        self.step_args, self.step_kwargs = args, kwargs
        self.results = []
        self.step_outputs = []
        self._losses_computed = 0
        self._chains.clear()  # (decided again by each step's first replay: the step's code may change between steps)
        self._steps[fn_name] = self._steps.get(fn_name, 0) + 1
        self._draw_step = self._step_position(fn_name, mode)
        if mode == "train":
            self.loss_weights.start()
        try:
            yield
        finally:
            self.batch = None

    def _step_position(self, fn_name: str, mode: Mode) -> int:
        """Where the step stands, the same on every rank: in training the batches the fit has started (restored
        on resume), otherwise the global step and the steps of ``fn_name`` run so far."""
        trainer = getattr(self.module, "_trainer", None)
        if trainer is not None and mode == "train":
            return draw_key(trainer.fit_loop.epoch_loop.batch_progress.total.ready)
        global_step = trainer.global_step if trainer is not None else 0
        return draw_key(zlib.crc32(fn_name.encode()), global_step, self._steps[fn_name])

    def _draws(self, run: StageRun) -> contextlib.AbstractContextManager:
        """Around a replay of the step for micro-batch :attr:`chunk`: every stage replays the step's code before
        (and, on the last, after) its layers, so what that code draws (a diffusion model's noise and time steps, a
        random mask) must be drawn alike on every stage: torch's generators are seeded from (seed, step,
        micro-batch, replica) and put back afterwards. The stage's own layers draw from a seed of their own (set at
        its first layer), so that one stage's dropout does not repeat another's; between two passes of a step
        through the layers the step's code draws from a seed of the step again (``partition.stage_run.end_pass``).
        Python's ``random`` and NumPy's generator are seeded (and put back) too where the step function's first
        steps drew from them (:meth:`_watching_python`)."""
        if self.draw_seed is None or self._inferring:
            return contextlib.nullcontext()
        key = draw_key(self.draw_seed, self._draw_step, self.chunk, self.dp_rank)
        run.layer_seed, run.pass_seed = draw_key(key, run.stage + 1), draw_key(key, 0)
        python = self.fn_name in self._python_draws
        if python or self._steps.get(self.fn_name, 0) > WATCHED_STEPS:
            return seeded_draws(key, python=python, device=self.device)
        return self._watching_python(key)

    @contextlib.contextmanager
    def _watching_python(self, key: int) -> Iterator[None]:
        """(A step function's first steps) :meth:`_draws` with Python's ``random`` and NumPy seeded too, noting
        whether the replay drew from them: if so, they are seeded at every replay of the step function from then on
        (~80 us each); otherwise torch's generators only (~2 us)."""
        with seeded_draws(key, python=True, device=self.device):
            before = python_states()
            try:
                yield
            finally:
                if python_drew(before):
                    self._python_draws.add(self.fn_name)

    def seed_hooks(self) -> None:
        """(At each batch's transfer to the device, and as a loader is set up) seed torch's generators, Python's
        ``random`` and NumPy's from (seed, the global step, the times this was called, replica), the same on every
        stage of a pipeline: what the hooks every
        rank runs draw from here on (random augmentations in ``on_after_batch_transfer``, in the next batch's
        ``on_before_batch_transfer``) is drawn alike on every stage. The step replays in between put the generators
        back as they found them (:meth:`_draws`)."""
        if self.draw_seed is None:
            return
        trainer = getattr(self.module, "_trainer", None)
        self._hooks_seeded += 1
        step = trainer.global_step if trainer is not None else 0
        reseed(draw_key(self.draw_seed, _HOOKS, step, self._hooks_seeded, self.dp_rank), self.device, python=True)

    def _micro_batch(self, idx: Tensor) -> Any:
        size = self.local_size

        def take(t: Any) -> Any:
            if isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == size:
                return t.index_select(0, idx if idx.device == t.device else idx.to(t.device))
            return t

        return _map_leaves(take, self.batch)

    def _call(self, micro_batch: Any) -> Any:
        if self.mode == "train" and has_loss_hook(self.module):
            return run_loss_hook(self.module, micro_batch)
        return getattr(self.module, self.fn_name)(micro_batch, *self.step_args, **self.step_kwargs)

    def stage_forward(self, stage: int, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        if stage == 0:  # the schedule's input: the micro-batch's rows of the local batch
            idx, acts = args[-1], args[:-1]
            if self._inferring:
                idx = torch.arange(idx.numel(), device=idx.device)
        else:  # the previous stage's activations; the rows follow from the micro-batch's index (not sent along)
            idx, acts = self._rows(0 if self._inferring else self.chunk), args
        if stage == self.last_stage:
            # the last stage's work happens in loss_fn, where the step's result is available
            return tuple(t.view_as(t) for t in (*acts, idx))
        key = (stage, self.fn_name)
        passes = self._passes_of(idx)
        middle = stage > 0 and not self._inferring and passes == 1
        chain = self._chains.get(key) if middle else None
        if chain is not None:  # torch's nn.Sequential chains the stage's layers: only they run (see _chains)
            run = StageRun(stage, first_stage=False, incoming=acts, exit_after=False, device=self.device)
            out = incoming_value(acts)
            with running(run), self._saving(), self._draws(run):
                for layer in chain:
                    out = layer(out)
            return _as_tensors(out, f"the last layer of stage {stage}")
        run = StageRun(
            stage, first_stage=stage == 0, incoming=acts or None, exit_after=True, device=self.device, passes=passes
        )
        run.training = self.mode == "train" and not self._inferring
        run.find_chain = middle and key not in self._chains
        if run.find_chain:
            run.ambient = ambient_state(self.device)
        micro_batch = self._micro_batch(idx)
        self._check_arguments(stage, micro_batch)
        with (
            running(run),
            self.capture.capturing(self.module, weight=0.0, keep=False),
            self._saving(),
            self._draws(run),
            self._kept_between(passes),
        ):
            try:
                self._call(micro_batch)
            except StageExit as stop:
                out = stop.output
            else:
                raise ModelContractError(
                    f"`{self.fn_name}` finished without running the layers of pipeline stage {stage}"
                    + (f" {passes} times, as its first step did" if passes > 1 else "")
                    + ". The step must call `self(x)` (or the layer sequence) and `forward` must run every layer of "
                    "the sequence."
                )
        if run.find_chain:
            self._chains[key] = run.chained
        where = f"the last layer of stage {stage}"
        return tuple(t for output in (out if passes > 1 else (out,)) for t in _as_tensors(output, where))

    def _passes_of(self, idx: Tensor) -> int:
        """How many times the step function runs the layer sequence (once, mostly; twice where the step calls the
        model on two views of its batch), counted on micro-batch ``idx`` once per step function
        (:func:`count_passes`)."""
        passes = self._passes.get(self.fn_name)
        if passes is None:
            passes = 1  # (one stage runs the step as it is: nothing to count)
            if self.last_stage > 0:
                micro_batch = self._micro_batch(idx)
                with self.capture.capturing(self.module, weight=0.0, keep=False):
                    passes = count_passes(lambda: self._call(micro_batch), self.module, self.device)
            self._passes[self.fn_name] = passes
        return passes

    def _kept_between(self, passes: int) -> contextlib.AbstractContextManager:
        """Around a stage's replay of a step with several passes, but the last stage's: the step's code between the
        passes runs there on stand-ins, whose metric updates and collected outputs are not kept."""
        return step_effects_kept(self.module) if passes > 1 else contextlib.nullcontext()

    def _rows(self, chunk: int) -> Tensor:
        """Micro-batch ``chunk``'s rows of the local batch."""
        return self.row_chunks(self.local_size, self.microbatches)[chunk]

    def row_chunks(self, local: int, microbatches: int) -> tuple[Tensor, ...]:
        """The rows of each micro-batch of a local batch of ``local`` samples, as torch's schedules cut a tensor (views
        of one ``arange``); made once."""
        key = (local, microbatches)
        chunks = self._rows_cache.get(key)
        if chunks is None:
            chunks = self._rows_cache[key] = torch.arange(local, device=self.device).tensor_split(microbatches)
        return chunks

    def loss_fn(self, output: Any, target: Tensor) -> Tensor:
        outs = output if isinstance(output, tuple) else (output,)
        acts = tuple(outs[:-1])
        idx = target
        if self._inferring:
            # a dense zero gradient: torch derives the backward buffers' strides from it
            parts = [(a.float() * torch.zeros(a.shape, device=a.device)).sum() for a in acts if a.requires_grad]
            return torch.stack(parts).sum() if parts else torch.zeros((), device=idx.device)
        micro_batch = self._micro_batch(idx)
        run = StageRun(
            self.last_stage,
            first_stage=self.last_stage == 0,
            incoming=acts or None,
            exit_after=False,
            device=self.device,
            passes=self._passes_of(idx),
        )
        run.training = self.mode == "train"
        microbatch, self._losses_computed = self._losses_computed, self._losses_computed + 1
        self._check_arguments(self.last_stage, micro_batch)
        self._check_result(micro_batch, acts, run.passes)
        # the last stage's layers run here (its forward_one_chunk only passes activations on)
        timed = self.clock.compute("forward", microbatch=microbatch, stage=self.last_stage, part="layers and loss")
        first_record = len(self.capture.records)
        watch = self.mode != "predict" and self._steps.get(self.fn_name, 0) <= WATCHED_STEPS
        with (
            timed,
            running(run),
            self.capture.capturing(self.module, weight=float(idx.numel()), keep=True),
            self._saving(),
            self.items.micro_batch(watch, training=self.mode == "train"),
            self.metric_calls.collecting() if self.metric_calls is not None else contextlib.nullcontext(),
            self._draws(run),
        ):
            result = self._call(micro_batch)
        if self.last_stage > 0 and not run.layers_started:
            raise ModelContractError(
                f"`{self.fn_name}` on the last pipeline stage never ran the layer sequence; it must compute its "
                f"result from `self(x)`."
            )
        if run.passes > 1 and len(run.outputs) != run.passes:
            raise ModelContractError(
                f"`{self.fn_name}` ran the layer sequence {len(run.outputs)} time(s), and {run.passes} times at its "
                f"first step. The stages of a pipeline send every pass's activations at once, so each step must call "
                f"the layers the same number of times."
            )
        return self._consume(result, idx, first_record)

    def warn_unweighted(self) -> None:
        """(After a training step, once its logged values are read: the device has little left to wait for) warn,
        once, if a loss given without an item count was a mean over targets that hold an ignore index."""
        flag, self._ignored = self._ignored, None
        if flag is not None and not self._warned_unweighted and bool(flag):
            self._warned_unweighted = True
            warnings.warn(UNWEIGHTED_MEAN, UserWarning, stacklevel=1)
        self.sums.warn_unsure()

    def _saving(self) -> Any:
        """Where autograd keeps what the forward saves: host memory when activations are offloaded (training)."""
        if self.activation_offload is None or self.mode != "train" or self._inferring:
            return contextlib.nullcontext()
        return self.activation_offload.saving()

    def _check_arguments(self, stage: int, micro_batch: Any) -> None:
        """Once per stage and step function: the first layer's arguments besides the hidden state (masks,
        positions, rotary tables) come out the same whatever the stand-ins for earlier stages hold."""
        key = (stage, self.fn_name)
        if stage == 0 or key in self._checked:
            return
        first, second = (self._layer_arguments(stage, micro_batch, fill) for fill in (0.0, 1.0))
        if first is not None and second is not None:
            check_reproducible(first.layer, first.arguments, second.arguments)
        self._checked.add(key)

    def _check_result(self, micro_batch: Any, acts: tuple[Tensor, ...], passes: int) -> None:
        """Once per step function, on the last stage of a pipeline: the step's result does not depend on what the
        stand-ins for modules of earlier stages hold (``partition.step_checks.stand_ins_used``)."""
        if self.last_stage == 0 or self.fn_name in self._results_checked:
            return
        self._results_checked.add(self.fn_name)
        incoming = tuple(a.detach() for a in acts) or None

        def last_stage_run() -> StageRun:
            return StageRun(
                self.last_stage,
                first_stage=False,
                incoming=incoming,
                exit_after=False,
                device=self.device,
                passes=passes,
            )

        with self.capture.capturing(self.module, weight=0.0, keep=False):
            used = stand_ins_used(lambda: self._call(micro_batch), last_stage_run, self.module, self.device)
        refuse_stand_ins_used(used, self.last_stage)

    def _layer_arguments(self, stage: int, micro_batch: Any, fill: float) -> StageProbe | None:
        """What the first layer of ``stage`` is called with when modules of other stages stand in with ``fill``."""
        run = StageRun(stage, first_stage=False, incoming=None, exit_after=True, device=self.device, stand_in=fill)
        run.probe = True
        devices = [self.device] if self.device is not None and self.device.type == "cuda" else []
        quiet = self.capture.capturing(self.module, weight=0.0, keep=False)
        with torch.random.fork_rng(devices=devices), torch.no_grad(), running(run), quiet, lists_kept(self.module):
            try:
                self._call(micro_batch)
            except StageProbe as probe:
                return probe
            except StageExit:
                return None
        return None

    def _consume(self, result: Any, idx: Tensor, first_record: int) -> Tensor:
        if self.mode == "train":
            loss = result.get("loss") if isinstance(result, Mapping) else result
            if not isinstance(loss, Tensor):
                raise ModelContractError(
                    "training_step must return the loss tensor (or a dict with 'loss') under spot_pipeline; "
                    "skipping a step by returning None cannot be coordinated across pipeline stages."
                )
            if not loss.requires_grad:
                raise ModelContractError("the loss returned by training_step does not depend on the model's output.")
            if loss is not result:
                extra = {k: v for k, v in result.items() if k not in ("loss", NUM_ITEMS, LOSS_REDUCTION)}
                if extra:
                    self.step_outputs.append(detached(extra))
            count, summed = None, self.sums.loss_sum
            # (a bare loss with nothing counted, the common case, has no count and nothing to weigh: skipped, as this
            # runs once per micro-batch on the critical path of 1F1B)
            if loss is not result or not self.items.plain() or summed or self.sums.names:
                counts = self.items.counts_by_tensor()
                count = self.items.count_of(result, loss)
                summed = self.sums.loss_is_sum(result, loss, self.items, counted=count is not None)
                if count is not None:
                    counts[id(loss)] = count
                elif (flag := self.items.ignored_targets) is not None:
                    self._ignored = either(self._ignored, flag)
                self.capture.weigh(first_record, counts)
                records = self.capture.records[first_record:]
                self.sums.mark(self.fn_name, records, self.items, summed_loss=loss if summed else None)
            backed = self.loss_weights.add(loss, count, int(idx.numel()), summed)
            if self.scaler is not None:  # fp16: one scale everywhere; per-sample gradients as large as on one
                backed = self.scaler.scale(backed) / self.scale_divisor  # process (the engine multiplies back)
            elif self.microbatches > 1:  # the step's mean over micro-batches (see divides_losses)
                backed = backed / self.microbatches
            return backed
        self.capture.weigh(first_record, self.items.counts_by_tensor())
        self.sums.mark(self.fn_name, self.capture.records[first_record:], self.items)
        if self.mode == "predict":
            self.results.append((idx, detached(result)))
        elif result is not None:  # (validation and test: what the step returns is the outputs of their batch hooks)
            self.step_outputs.append(detached(result))
        return torch.zeros((), device=idx.device)
