"""Runs of the user's step, once per step function, that show what a pipeline can replay of it.

    passes = count_passes(step, module, device)               # how often the step runs the layer sequence
    used = stand_ins_used(step, last_stage_run, module, device)  # modules of earlier stages the result depends on

``step()`` replays the step on one micro-batch. Each run is quiet: no gradients, the module in eval mode (no
dropout, no running statistics updated), and the process's random generators (torch's, Python's, NumPy's), the
module's metrics and collected lists and ``trainer.should_stop`` as they were.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from lightning_spot.partition.discovery import ModelContractError
from lightning_spot.partition.stage_run import StageRun, running
from lightning_spot.replay.draws import seeded_draws
from lightning_spot.replay.metric_states import metrics_kept
from lightning_spot.replay.module_lists import lists_kept

log = logging.getLogger(__name__)


@contextlib.contextmanager
def evaluating(module: nn.Module) -> Iterator[None]:
    """``module`` in eval mode (no dropout, no running statistics updated) in the block; then each submodule in the
    mode it had (a frozen teacher the user keeps in eval mode stays so)."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


@contextlib.contextmanager
def step_effects_kept(module: nn.Module) -> Iterator[None]:
    """The module's torchmetrics states and the lists its steps append to as they were before the block."""
    with metrics_kept(module), lists_kept(module):
        yield


@contextlib.contextmanager
def quiet_run(module: nn.Module, device: torch.device | None) -> Iterator[None]:
    """Around an extra run of the step: nothing of it stays (see the module docstring); the draws start from one
    seed, so that two runs draw alike."""
    trainer = getattr(module, "_trainer", None)
    stop = getattr(trainer, "should_stop", False)
    try:
        with (
            seeded_draws(0, python=True, device=device),
            torch.no_grad(),
            evaluating(module),
            step_effects_kept(module),
        ):
            yield
    finally:
        if trainer is not None:
            trainer.should_stop = stop


def tensors_of(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _differences(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[float] | None:
    """The largest difference between each pair of tensors (inf where NaNs do not match); None where the two
    results have different structures."""
    if len(a) != len(b):
        return None
    out = []
    for x, y in zip(a, b):
        if x.shape != y.shape or x.dtype != y.dtype:
            return None
        if not x.is_floating_point():
            out.append(0.0 if torch.equal(x, y) else float("inf"))
            continue
        x, y = x.float(), y.float()
        same = (x == y) | (x.isnan() & y.isnan())
        gap = torch.where(same, torch.zeros_like(x), (x - y).abs().nan_to_num(nan=float("inf")))
        out.append(float(gap.max()) if gap.numel() else 0.0)
    return out


#: differences smaller than this share of a tensor's largest value (or of 1) are taken for run-to-run noise, however
#: little one run of the step differed from another (one sample of a GPU's non-deterministic kernels can be tiny)
NOISE_FLOOR = 1e-4


def _scale(t: torch.Tensor) -> float:
    if not t.is_floating_point() or not t.numel():
        return 1.0
    return max(1.0, float(t.detach().abs().nan_to_num(0.0, posinf=0.0, neginf=0.0).max()))


def changed_beyond_noise(base: list[torch.Tensor], other: list[torch.Tensor], again: list[torch.Tensor]) -> bool:
    """Whether ``other`` differs from ``base`` by more than ``again``, a run of the same step, does (none on the CPU;
    non-deterministic kernels on a GPU can make it more), and by more than :data:`NOISE_FLOOR` of its values."""
    noise = _differences(base, again)
    if noise is None:  # (the step's result changes from run to run: nothing to tell)
        return False
    gaps = _differences(base, other)
    if gaps is None:
        return True
    return any(gap > max(10 * tolerated, NOISE_FLOOR * _scale(t)) for gap, tolerated, t in zip(gaps, noise, base))


def _quietly(step: Callable[[], Any], run: StageRun, module: nn.Module, device: torch.device | None) -> Any:
    with quiet_run(module, device), running(run):
        return step()


def count_passes(step: Callable[[], Any], module: nn.Module, device: torch.device | None) -> int:
    """How many times ``step()`` runs the layer sequence, found by a run in which every layer passes on a constant
    and modules of other stages stand in; 1 where the step cannot run so (it then runs as one pass). With several
    passes, a second run with another constant shows whether a pass's input depends on an earlier pass's output (the
    sequence applied again to what it returned), which a pipeline cannot do: its stages run all passes of a
    micro-batch at once (a third run, with the first constant again, shows how much runs differ anyway)."""
    inputs = []
    for fill in (0.0, 1.0, 0.0):  # (the last: how much a run of the same step differs)
        run = StageRun(-1, first_stage=False, incoming=None, exit_after=False, device=device, counting=True)
        run.pass_fill = fill
        try:
            _quietly(step, run, module, device)
        except Exception as err:  # (e.g. code that reads values the stand-ins cannot give)
            log.info("lightning-spot: the step runs as one pass; it could not run to count its passes (%r)", err)
            return 1
        inputs.append(run.outputs)  # (the first layer's input in each pass)
        if len(run.outputs) < 2 or len(run.outputs) != len(inputs[0]):
            return 1
    for index, (base, other, again) in enumerate(zip(*inputs)):
        if changed_beyond_noise(tensors_of(base), tensors_of(other), tensors_of(again)):
            raise ModelContractError(
                f"Pass {index + 1} of the step through the layer sequence takes an input computed from what an "
                f"earlier pass returned (the layers applied again to their own output). A pipeline cannot run that: "
                f"each stage runs all of a micro-batch's passes at once and sends them on together. Passes on "
                f"inputs of their own (two views of a batch, chosen and rejected answers) work; for repeated layers, "
                f"let the sequence hold them twice (`nn.Sequential(*layers, *layers)` shares their weights)."
            )
    return len(inputs[0])


def stand_ins_used(
    step: Callable[[], Any], last_stage_run: Callable[[], StageRun], module: nn.Module, device: torch.device | None
) -> list[str]:
    """(The last stage) the modules of earlier stages whose stand-ins the step's result depends on: the step uses,
    after the layers, what such a module computed (a teacher run before the student, an embedding's output added
    around the whole sequence), which only the hidden state could have carried to the last stage. Found by runs
    whose stand-ins hold 0 and 1 (one module's at a time, where they differ), compared with a second run at 0 (a GPU's
    non-deterministic kernels may differ a little between runs); empty where the step cannot run so."""

    def result(fill: float, only: str | None = None) -> tuple[list[torch.Tensor], list[str]]:
        run = last_stage_run()
        run.stand_in, run.stood_in = (0.0, []) if only is not None else (fill, [])
        run.stand_in_for = {only: fill} if only is not None else None
        return tensors_of(_quietly(step, run, module, device)), run.stood_in

    try:
        base, stood_in = result(0.0)
        if not stood_in:
            return []
        again = result(0.0)[0]  # (how much a run of the same step differs: nothing on the CPU)
        if not changed_beyond_noise(base, result(1.0)[0], again):
            return []
        used = [fqn for fqn in dict.fromkeys(stood_in) if changed_beyond_noise(base, result(1.0, only=fqn)[0], again)]
        return used or stood_in
    except Exception as err:  # (the step's own run names what fails in it)
        log.info("lightning-spot: could not check what the step's result depends on (%r)", err)
        return []


def refuse_stand_ins_used(used: list[str], stage: int) -> None:
    if used:
        names = ", ".join(f"`{fqn}`" for fqn in used)
        raise ModelContractError(
            f"The step uses, after the layer sequence, what {names} computed on an earlier pipeline stage: only the "
            f"hidden state travels between stages, so the last stage (stage {stage}) has a stand-in there and "
            f"training would differ from one process. A teacher or reference model run before the model's forward: "
            f"run it after `self(x)`, which places it on the last stage. A value used around the layers (an "
            f"embedding's output added after them, a skip connection over the whole sequence): carry it through the "
            f"layers, or compute it on the last stage."
        )
