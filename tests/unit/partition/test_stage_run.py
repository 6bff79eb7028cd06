"""A stage's first layer, called by the user's step on a later pipeline stage (partition/stage_run.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_spot import discover, plan_stages
from lightning_spot.partition.discovery import ModelContractError
from lightning_spot.partition.placement import place_stages
from lightning_spot.partition.stage_run import StageExit, StageRun, instrument_layer, running
from lightning_spot.runtime.logging_bridge import LogCapture
from lightning_spot.runtime.step_runner import StepRunner


class MaskedLinear(nn.Linear):
    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        out = super().forward(x)
        return out if mask is None else out * mask


def _layer() -> nn.Module:
    layer = MaskedLinear(4, 4)
    instrument_layer(layer, "layers.2", stage=1, first=True, last=True)
    return layer


def test_first_layer_takes_the_received_activation() -> None:
    layer, received = _layer(), torch.randn(2, 4)
    run = StageRun(1, first_stage=False, incoming=(received,), exit_after=True)
    with running(run), pytest.raises(StageExit) as stop:
        layer(torch.zeros(2, 4, device="meta"), torch.ones(2, 4))  # the stand-in input is replaced
    torch.testing.assert_close(stop.value.output, nn.Linear.forward(layer, received))


@pytest.mark.parametrize("by_name", [False, True])
def test_an_argument_made_on_another_stage_is_refused_by_name(by_name: bool) -> None:
    layer = _layer()
    meta_mask = torch.ones(2, 4, device="meta")  # what a module of an earlier stage would have computed here
    run = StageRun(1, first_stage=False, incoming=(torch.randn(2, 4),), exit_after=True)
    name = "mask" if by_name else "positional argument 2"
    with running(run), pytest.raises(ModelContractError, match=f"received `{name}` computed by modules that live"):
        if by_name:
            layer(torch.zeros(2, 4), mask=meta_mask)
        else:
            layer(torch.zeros(2, 4), meta_mask)


# ---------------------------------------------------------------- stages between the first and the last
WIDTH = 8


class _Stack(nn.Module):
    """A step function around a layer sequence; ``calls`` counts its runs. ``between``: the user's code scales
    layer 2's output before layer 3 (the layers are then not chained by ``nn.Sequential`` alone); ``container``:
    the type holding the layers; ``boundary``: code after every layer, at stage boundaries too."""

    def __init__(
        self, between: bool = False, container: type[nn.Sequential] = nn.Sequential, boundary: str = ""
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = container(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(6)])
        self.between = between
        self.boundary = boundary
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.between and not self.boundary:
            return self.layers(x)
        for i, layer in enumerate(self.layers):
            x = layer(x) * (2 if self.between and i == 2 else 1)
            x = _BOUNDARY_CODE[self.boundary](x) if self.boundary else x
        return x

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.calls += 1
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)


class _OwnSequential(nn.Sequential):
    pass


#: code a step runs after every layer: what changes the hidden state, and what only copies it
_BOUNDARY_CODE = {
    "scale": lambda x: x * 0.5,
    "residual": lambda x: x + x.detach(),
    "dropout": lambda x: nn.functional.dropout(x, 0.5, training=True),
    "copy": lambda x: x.clone(),
    "same dtype": lambda x: x.float().contiguous(),
}


def _middle_stage(module: _Stack) -> tuple[StepRunner, list[nn.Module]]:
    """``module`` cut into 3 stages, as pipeline rank 1 holds it (layers 2 and 3), and those layers."""
    reference = list(module.layers)[2:4]
    split = discover(module)
    place_stages(module, split, plan_stages(split.num_layers, 3), pp_rank=1, device=torch.device("cpu"))
    return StepRunner(module, num_stages=3, capture=LogCapture(), device=torch.device("cpu")), reference


@pytest.mark.parametrize(
    ("between", "container", "chained"),
    [(False, nn.Sequential, True), (True, nn.Sequential, False), (False, _OwnSequential, False)],
    ids=["sequential", "user-code-between-layers", "sequential-subclass"],
)
def test_a_middle_stage_runs_only_its_layers_once_a_replay_showed_torch_chains_them(
    between: bool, container: type[nn.Sequential], chained: bool
) -> None:
    """A stage that is neither the first nor the last replays the user's step up to its layers; when that replay
    shows torch's own ``nn.Sequential.forward`` calling them, later micro-batches call only the layers (nothing of
    the user's code runs before them on this stage anyway). User code between the layers, or a container of the
    user's, keeps the replay. Either way the output is what the layers (and the user's code between them) give."""
    module = _Stack(between, container)
    runner, layers = _middle_stage(module)
    batch = (torch.randn(8, WIDTH), torch.randn(8, WIDTH))
    received = torch.randn(4, WIDTH, requires_grad=True)
    between_them = layers[0](received) * (2 if between else 1)  # (what follows the stage's last layer is not its)
    expected = layers[1](between_them)
    with runner.bind("training_step", "train", batch, (0,), {}, microbatches=2):
        outputs = []
        for chunk in (0, 1, 0):
            runner.chunk = chunk
            outputs.append(runner.stage_forward(1, (received,))[0])
    replays = module.calls - 3  # (the first replay of a middle stage also probes the first layer's arguments twice,
    # and the step's first run counts its passes through the layers)
    assert replays == (1 if chained else 3)
    for out in outputs:
        torch.testing.assert_close(out, expected)
    outputs[-1].sum().backward()  # the chained call is part of the autograd graph like the replay
    assert received.grad is not None and layers[0][0].weight.grad is not None


class _OwnAutocast(_Stack):
    """A step that runs the layers under an autocast of its own (bf16 on the CPU) from batch ``from_batch`` on."""

    def __init__(self, from_batch: int) -> None:
        super().__init__()
        self.from_batch = from_batch

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.calls += 1
        x, y = batch
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=batch_idx >= self.from_batch):
            out = self(x)
        return torch.nn.functional.mse_loss(out.float(), y)


@pytest.mark.parametrize("from_batch", [0, 1], ids=["every-step", "from-the-second-step"])
def test_a_middle_stage_keeps_the_step_s_own_autocast_on_every_micro_batch(from_batch: int) -> None:
    """Calling a middle stage's layers alone leaves out the step's code around them: where that code runs them
    under a context of its own (here an autocast, from some step on), every micro-batch of the step is replayed
    (and computes in bf16 like the first), and the choice is made again at each step."""
    module = _OwnAutocast(from_batch)
    runner, layers = _middle_stage(module)
    received = torch.randn(4, WIDTH)
    batch = (torch.randn(8, WIDTH), torch.randn(8, WIDTH))
    for batch_idx in (0, 1):
        calls = module.calls
        with runner.bind("training_step", "train", batch, (batch_idx,), {}, microbatches=2):
            outputs = []
            for chunk in (0, 1):
                runner.chunk = chunk
                outputs.append(runner.stage_forward(1, (received,))[0])
        own = batch_idx >= from_batch
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=own):
            expected = layers[1](layers[0](received))
        for out in outputs:
            assert out.dtype == (torch.bfloat16 if own else torch.float32)
            torch.testing.assert_close(out, expected)
        probes = 3 if batch_idx == 0 else 0  # (the first replay of a middle stage also probes the first layer twice,
        # and the step's first run counts its passes)
        assert module.calls - calls - probes == (2 if own else 1)  # replayed every micro-batch, or the layers chained


def test_a_middle_stage_chains_its_layers_under_an_autocast_around_the_whole_step() -> None:
    """An autocast around the whole step (what ``precision="bf16-mixed"`` puts around the schedule) is there for the
    layers called alone too: the layers are chained, in bf16."""
    module = _Stack()
    runner, layers = _middle_stage(module)
    received = torch.randn(4, WIDTH)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with runner.bind("training_step", "train", (torch.randn(8, WIDTH), torch.randn(8, WIDTH)), (0,), {}, 2):
            outputs = []
            for chunk in (0, 1):
                runner.chunk = chunk
                outputs.append(runner.stage_forward(1, (received,))[0])
        expected = layers[1](layers[0](received))
    assert module.calls - 3 == 1  # one replay (besides the probes and the count of passes), then the layers alone
    for out in outputs:
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("code", ["scale", "residual", "dropout"])
@pytest.mark.parametrize("stage", [1, 2])
def test_code_that_changes_the_hidden_state_at_a_stage_boundary_is_refused(code: str, stage: int) -> None:
    """Code between the last layer of a stage and the first of the next would be skipped (the stage sends its last
    layer's output as it is): the first replay on the later stage (a middle one, or the last) refuses it, naming the
    two layers, instead of training something else than one process does."""
    module = _Stack(boundary=code)
    split = discover(module)
    place_stages(module, split, plan_stages(split.num_layers, 3), pp_rank=stage, device=torch.device("cpu"))
    runner = StepRunner(module, num_stages=3, capture=LogCapture(), device=torch.device("cpu"))
    batch = (torch.randn(8, WIDTH), torch.randn(8, WIDTH))
    received = torch.randn(4, WIDTH, requires_grad=True)
    first = 2 * stage  # (two layers per stage)
    expected = f"between layer `layers.{first - 1}` and layer `layers.{first}`"
    bound = runner.bind("training_step", "train", batch, (0,), {}, microbatches=2)
    with bound, pytest.raises(ModelContractError, match=expected):
        if stage == 2:
            runner.loss_fn(runner.stage_forward(2, (received,)), torch.arange(4))
        else:
            runner.stage_forward(1, (received,))


@pytest.mark.parametrize("code", ["copy", "same dtype"])
def test_code_at_a_stage_boundary_that_keeps_the_hidden_state_s_values_is_allowed(code: str) -> None:
    """A copy, or a cast to the dtype the hidden state has, changes nothing that the next stage would miss."""
    module = _Stack(boundary=code)
    runner, layers = _middle_stage(module)
    received = torch.randn(4, WIDTH)
    with runner.bind("training_step", "train", (torch.randn(8, WIDTH), torch.randn(8, WIDTH)), (0,), {}, 2):
        out = runner.stage_forward(1, (received,))[0]
    torch.testing.assert_close(out, layers[1](layers[0](received)))


def test_a_forward_pre_hook_that_changes_a_stage_s_first_input_is_refused() -> None:
    """The received activation replaces the first layer's input after its forward pre-hooks ran: a hook that
    changes that input would be skipped, so the probe refuses it as code between the layers."""
    module = _Stack()
    module.layers[2].register_forward_pre_hook(lambda layer, args: (args[0] * 3,))
    runner, _ = _middle_stage(module)
    bound = runner.bind("training_step", "train", (torch.randn(8, WIDTH), torch.randn(8, WIDTH)), (0,), {}, 2)
    with bound, pytest.raises(ModelContractError, match="a forward pre-hook on `layers.2`"):
        runner.stage_forward(1, (torch.randn(4, WIDTH),))


def test_a_collective_inside_a_step_stops_with_where_to_do_it_instead() -> None:
    """``self.all_gather`` (or the strategy's reduce, broadcast, barrier) inside a step function would be reached by
    the last stage only (the others leave the step at their last layer): every rank would wait until the step
    timeout. Inside a stage's run it stops at once, naming the hooks to use; outside a step it works as in Lightning."""
    from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available

    from lightning_spot import SpotPipelineStrategy

    strategy = SpotPipelineStrategy()
    value = torch.ones(2)
    run = StageRun(1, first_stage=False, incoming=None, exit_after=False)
    calls = {
        "`self.all_gather`": lambda: strategy.all_gather(value),
        "`reduce`": lambda: strategy.reduce(value),
        "`broadcast`": lambda: strategy.broadcast(value),
        "`barrier`": lambda: strategy.barrier(),
    }
    for name, call in calls.items():
        with running(run), pytest.raises(ModelContractError, match=f"{name}.*on_validation_epoch_end"):
            call()
    # outside a step: Lightning's (in this process a group may be left over from another test)
    assert torch.equal(strategy.all_gather(value), _all_gather_ddp_if_available(value))
