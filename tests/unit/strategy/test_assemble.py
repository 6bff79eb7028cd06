"""The strategy's recipes in one process, with a fake engine: what ``build_pipeline`` hands the engine at construction
and the order of its steps; how ``optimizer_step`` composes the step's closure."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, ClassVar

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import Precision

from lightning_spot import SpotPipelineStrategy, TorchFT
from lightning_spot.checkpoint.sources import StateSources
from lightning_spot.runtime.offload import ActivationOffload
from lightning_spot.strategy import assemble
from lightning_spot.strategy.settings import PipelineSettings
from tests.models import make_model

CPU = torch.device("cpu")


class FakeEngine:
    """Records what it was built with and what was asked of it afterwards (``calls``, in order)."""

    built: ClassVar[list[FakeEngine]] = []

    def __init__(self, module: Any, split: Any, layout: Any, ctx: Any, **kwargs: Any) -> None:
        self.module, self.split, self.layout, self.ctx, self.kwargs = module, split, layout, ctx, kwargs
        self.ties = SimpleNamespace(aliases={})
        self.calls: list[tuple[str, dict[str, Any]]] = []
        FakeEngine.built.append(self)

    def describe(self) -> str:
        return "fake engine"

    def wrap_data_parallel(self, **kwargs: Any) -> None:
        self.calls.append(("wrap_data_parallel", kwargs))


class RecordingPrecision(Precision):
    def __init__(self, engines: list[FakeEngine]) -> None:
        self.engines = engines

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        self.engines[-1].calls.append(("convert_module", {}))
        return module


def build(monkeypatch: pytest.MonkeyPatch, *, rank: int = 1, **settings: Any) -> tuple[assemble.BuiltPipeline, list]:
    FakeEngine.built = []
    monkeypatch.setattr(assemble, "PipelineEngine", FakeEngine)
    module = make_model()
    module.trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    monkeypatch.setattr(assemble, "shared_sample_batch", lambda trainer: None)  # (no data: modules placed by order)
    hooks: list[int] = []
    built = assemble.build_pipeline(
        module,
        PipelineSettings.from_args(pipeline_stages=2, microbatches=2, schedule="1F1B", **settings),
        StateSources(),
        precision=RecordingPrecision(FakeEngine.built),
        device=CPU,
        rank=rank,
        world_size=2,
        compiler=None,
        trace_allreduce=False,
        grads_final=hooks.append,
    )
    return built, hooks


def test_the_engine_gets_everything_at_construction_and_the_steps_run_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    built, hooks = build(monkeypatch, rank=1)
    (engine,) = FakeEngine.built
    assert built.engine is engine and str(built.choice.layout.grid) == "P2xD1"
    assert engine.layout is built.choice.layout and engine.split.layers_path == "layers"
    assert (engine.ctx.pp_rank, engine.ctx.dp_rank, engine.ctx.pp_group) == (1, 0, None)  # no process group here
    kwargs = engine.kwargs
    assert kwargs["scaler"] is None and kwargs["activation_offload"] is None  # fp32: no loss scale; nothing offloaded
    assert kwargs["optimizer_offload"] is False and kwargs["replica_group"] is None
    kwargs["grads_final"][0](3)
    assert hooks == [3]  # the strategy's hook, handed in (not appended to the engine's runner afterwards)
    # pretrained weights (none here), then the precision's conversion, then the data-parallel wrapping
    assert engine.calls == [
        ("convert_module", {}),
        ("wrap_data_parallel", {"trace_allreduce": False, "stream_weights": False}),
    ]
    assert built.pretrained_reads == []


def test_offload_and_torchft_are_handed_to_the_engine_as_it_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    build(monkeypatch, offload=["activations", "optimizer"])
    kwargs = FakeEngine.built[0].kwargs
    assert isinstance(kwargs["activation_offload"], ActivationOffload) and kwargs["optimizer_offload"] is True

    build(monkeypatch, fault_tolerance=TorchFT(lighthouse="http://127.0.0.1:1", replica_group="3"))
    assert FakeEngine.built[0].kwargs["replica_group"] == "3"


class RecordingReplicas:
    """A replica group that wraps the step's closure and notes when it runs."""

    def __init__(self, order: list[str]) -> None:
        self.order = order

    def committed(self, closure: Any, weight: Any, keep: Any) -> Any:
        def run() -> Any:
            self.order.append("replicas: before the schedule")
            result = closure()
            self.order.append(f"replicas: commit, weight {weight()}")
            return result

        return run

    def shutdown(self) -> None:
        pass


def test_the_optimizer_step_runs_the_schedule_inside_the_replicas_then_settles_the_step_agreement() -> None:
    strategy = SpotPipelineStrategy(pipeline_stages=1)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_checkpointing=False)
    module = make_model()
    module.trainer = trainer
    strategy.connect(module)
    order: list[str] = []
    strategy.engine = SimpleNamespace(  # type: ignore[assignment]
        runner=SimpleNamespace(loss_weights=SimpleNamespace(items=7.0)), keep_step=lambda: lambda: None, clock=None
    )
    strategy._replicas = RecordingReplicas(order)  # type: ignore[assignment]
    strategy.step_agreement.join("test", lambda: [1.0], lambda values: order.append(f"agreed {values}"))
    strategy.step_agreement.post(CPU)  # (at the batch's start)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    optimizer.register_step_post_hook(lambda *_: order.append("optimizer step"))

    def schedule() -> torch.Tensor:
        order.append("schedule")
        return torch.tensor(0.5)

    strategy.optimizer_step(optimizer, schedule, module)
    assert order == [
        "replicas: before the schedule",
        "schedule",
        "replicas: commit, weight 7.0",
        "optimizer step",
        "agreed [1.0]",  # every rank has posted it by the end of its optimizer step
    ]
