"""Tiny LightningModules and data shared by the tests and their worker processes."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BasePredictionWriter, ModelSummary
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset, WeightedRandomSampler

IN, HIDDEN, OUT = 6, 16, 3


class Block(nn.Module):
    def __init__(self, width: int, repeats: int = 1) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.repeats = repeats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # repeats > 1: a layer that costs more time than the others (each step scaled down so the
        # deep chain stays well conditioned and float reordering between layouts stays tiny)
        for _ in range(self.repeats):
            x = x + torch.tanh(self.fc(x)) / self.repeats
        return x


class TinyPipelineModel(L.LightningModule):
    """embed -> layers (a Sequential of residual blocks) -> head; MSE loss. An ordinary LightningModule."""

    def __init__(
        self,
        num_layers: int = 4,
        optimizer: str = "adam",
        lr: float = 0.05,
        scheduler: bool = False,
        width: int = HIDDEN,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Linear(IN, width)
        self.layers = nn.Sequential(*[Block(width) for _ in range(num_layers)])
        self.head = nn.Linear(width, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(torch.relu(self.embed(x))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", F.mse_loss(self(x), y))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        return self(x)

    def configure_optimizers(self) -> Any:
        if self.hparams.optimizer == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        else:
            opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        if self.hparams.scheduler:
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)}
        return opt


def make_dataset(n: int = 64, seed: int = 1234) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN, generator=g)
    w = torch.randn(IN, OUT, generator=g)
    return TensorDataset(x, torch.tanh(x @ w))


class RandomCrops(torch.utils.data.Dataset):
    """Samples cut at random from a long series, as language-model datasets crop their windows: ``x`` and its target
    come from one window drawn in ``__getitem__`` (torch), scaled by a factor drawn from Python's ``random`` and
    shifted by one from NumPy's global generator. A stage that drew another window would pair one sample's input
    with another one's target."""

    def __init__(self, n: int = 64, length: int = 400) -> None:
        g = torch.Generator().manual_seed(0)
        self.n, self.series, self.w = n, torch.randn(length, IN, generator=g), torch.randn(IN, OUT, generator=g)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(torch.randint(0, len(self.series) - 1, ()))
        x = self.series[start] * random.uniform(0.5, 1.5) + float(np.random.normal(0.0, 0.1))
        return x, torch.tanh(x @ self.w)


class UserSamplerData(L.LightningDataModule):
    """make_dataset(n) through the ``DistributedSampler`` a user builds for ``trainer.world_size`` processes, as plain
    PyTorch DDP code does (shuffled, seed 0): one replica in a single process."""

    def __init__(self, batch_size: int, n: int) -> None:
        super().__init__()
        self.batch_size, self.n = batch_size, n

    def train_dataloader(self) -> DataLoader:
        dataset, trainer = make_dataset(self.n), self.trainer
        assert trainer is not None
        sampler = DistributedSampler(
            dataset, num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=True, seed=0
        )
        return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler)


class StoppingModel(TinyPipelineModel):
    """Stops training from inside its step, after the forward (which only a pipeline's last stage reaches). In
    training (``stop_in="training"``): from step 2 on once a batch holds a first target above 0.99: with
    make_dataset(64) in batches of 16, at step 2, whose row above it is in replica 0's rows on P2D2. In validation:
    at the first validation from step 2 on."""

    def __init__(self, stop_in: str = "training", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stop_in = stop_in

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss)
        if self.stop_in == "training" and self.global_step >= 2 and bool((y[:, 0] > 0.99).any()):
            self.trainer.should_stop = True
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))
        if self.stop_in == "validation" and self.global_step >= 2:
            self.trainer.should_stop = True


class NoisyStepModel(TinyPipelineModel):
    """Draws at random where Lightning users do: its step learns to recover noise added to the input (as diffusion
    models train: the noise is drawn in the step, before the forward, and is the target after it), and augmentations
    are drawn in both batch transfer hooks (training only). A stage that drew other noise than the last stage's
    would train on noise the model never saw."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        noise = torch.randn(x.shape[0], OUT)
        loss = F.mse_loss(self(x + noise.repeat(1, IN // OUT) * 0.5), noise)
        self.log("train_loss", loss)
        return loss

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self.trainer.training:
            x, y = batch
            return x * (1.0 + 0.1 * torch.rand(x.shape[0], 1)), y
        return batch

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self.trainer.training:
            x, y = batch
            return x + 0.1 * torch.randn_like(x), y
        return batch


class DistilledModel(TinyPipelineModel):
    """Knowledge distillation as it is often written: a frozen teacher runs on the batch first, then the model, and
    the loss pulls the model's output towards the labels and the teacher's. Only the loss (after the layers) uses
    the teacher's output, so it belongs with the last stage although the step runs it first."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.teacher = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT)).requires_grad_(False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        with torch.no_grad():
            target = self.teacher(x)
        out = self(x)
        loss = F.mse_loss(out, y) + 0.5 * F.mse_loss(out, target)
        self.log("train_loss", loss)
        return loss


class EncoderModel(L.LightningModule):
    """A small transformer written with torch's own ``nn.TransformerEncoder`` (a causal mask, pre-norm layers; its
    forward reads its first layer's attributes) and loose parameters set directly on the module, as ViTs and CLIP
    have them: a learned position table added before the layers (the first stage's) and a temperature that scales
    the output after them (registered first too, but used only after the layers: the last stage's). Each sample's
    six inputs are a sequence of three tokens of two features."""

    def __init__(self, optimizer: str = "sgd", lr: float = 0.01, **_: Any) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.temperature = nn.Parameter(torch.tensor(1.5))
        self.pos = nn.Parameter(torch.randn(3, HIDDEN) * 0.1)
        self.embed = nn.Linear(IN // 3, HIDDEN)
        layer = nn.TransformerEncoderLayer(HIDDEN, 2, 2 * HIDDEN, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.view(x.shape[0], 3, IN // 3)) + self.pos
        h = self.encoder(h, mask=nn.Transformer.generate_square_subsequent_mask(3), is_causal=True)
        return self.head(h.mean(1)) * self.temperature

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class CheckpointedModel(TinyPipelineModel):
    """Activation checkpointing written by hand, as nanoGPT-style code does: each block under
    ``torch.utils.checkpoint.checkpoint`` in training (``reentrant``: torch's older variant)."""

    def __init__(self, reentrant: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.embed(x))
        checkpoint = torch.utils.checkpoint.checkpoint
        for block in self.layers:
            h = checkpoint(block, h, use_reentrant=self.reentrant) if self.training else block(h)
        return self.head(h)


class SharedBlockModel(TinyPipelineModel):
    """One block at every place of the sequence (ALBERT's and universal transformers' weight sharing): each stage
    holds the same module at two places, and every stage holds it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.layers = nn.Sequential(*([self.layers[0]] * len(self.layers)))


class CompiledBlocksModel(TinyPipelineModel):
    """Blocks the user compiled one by one (``torch.compile(block)``, as torchtitan does), with ``aot_eager`` (dynamo
    and AOT autograd without a C++ build); the layer sequence holds torch's compiled wrappers."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.layers = nn.Sequential(*(torch.compile(block, backend="aot_eager") for block in self.layers))


class PythonDrawsModel(TinyPipelineModel):
    """Draws with Python's ``random`` and NumPy where older and ported code does: its step scales the input by a
    factor from ``random`` and learns to recover NumPy noise added to it (the target after the forward), and
    ``on_after_batch_transfer`` flips the sign of the input with ``random``'s coin (training only). A stage that
    drew otherwise than the last stage would train on noise the model never saw."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        noise = torch.from_numpy(np.random.standard_normal((x.shape[0], OUT))).float()
        scale = random.uniform(0.5, 1.5)
        loss = F.mse_loss(self(x * scale + noise.repeat(1, IN // OUT) * 0.5), noise)
        self.log("train_loss", loss)
        return loss

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self.trainer.training and random.random() < 0.5:
            x, y = batch
            return -x, y
        return batch


class TwoPassModel(TinyPipelineModel):
    """A step that runs the model twice, on two views of its batch (as consistency training, contrastive views or
    chosen/rejected answers do), with a loss that couples the two; validation compares two views as well. ``noise``:
    the second view's noise is drawn between the two passes and is the second pass's target too, so a stage that drew
    other noise than the last stage's would train on noise the model never saw."""

    def __init__(self, noise: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.noise = noise

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        first = self(x)
        if self.noise:
            noise = torch.randn(x.shape[0], OUT)
            second = self(x + noise.repeat(1, IN // OUT) * 0.5)
            loss = F.mse_loss(first, y) + F.mse_loss(second - first.detach(), noise)
        else:
            second = self(x * 0.5 + 0.1)
            loss = F.mse_loss(first, y) + 0.5 * F.mse_loss(second, first)
        self.log("consistency", F.mse_loss(second, first))
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y) + F.mse_loss(self(x * 0.5), y))


class StreamDataset(torch.utils.data.IterableDataset):
    """A resumable stream of :func:`make_dataset`'s samples: each pass in the order of a permutation seeded by its
    pass number (shuffled like a stream's shuffle buffer), passes one after another; ``state_dict`` is the pass and
    the samples read in it, and iterating continues from there (a finished pass: the next one begins)."""

    def __init__(self, n: int = 64, shuffle: bool = True) -> None:
        self.data = make_dataset(n)
        self.shuffle = shuffle
        self.epoch, self.position = 0, 0
        self.samples_read = 0  # in this process (pipeline stages that receive their batches read none)

    def _order(self) -> list[int]:
        n = len(self.data)
        return (
            torch.randperm(n, generator=torch.Generator().manual_seed(self.epoch)).tolist()
            if self.shuffle
            else list(range(n))
        )

    def __iter__(self) -> Any:
        order = self._order()
        if self.position >= len(order):
            self.epoch, self.position = self.epoch + 1, 0
            order = self._order()
        while self.position < len(order):
            self.position += 1
            self.samples_read += 1
            yield self.data[order[self.position - 1]]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class OrderedPasses(torch.utils.data.IterableDataset):
    """:func:`make_dataset`'s samples, pass ``k`` (the ``k``-th ``iter()``) in the order ``passes[k]``."""

    def __init__(self, n: int, passes: list[list[int]]) -> None:
        self.data, self.passes, self.epoch = make_dataset(n), passes, 0

    def __iter__(self) -> Any:
        order, self.epoch = self.passes[self.epoch], self.epoch + 1
        return iter([self.data[i] for i in order])


class TrainedCount:
    """The global batches a test's replicas trained in the pass, which their stream loaders read as Lightning's count
    (``progress=``). The loaders hold this object, not the test's: a reference cycle through the test's object
    would leave their DataLoader workers to Python's cycle collector, which shuts each worker down only after 5 s
    (the worker queues are finalised before the iterator) -- in whatever test happens to run then."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def __call__(self) -> int:
        return self.value


class ReplicaStream(StreamDataset):
    """Replica ``rank`` of ``replicas``'s part of :class:`StreamDataset`'s global batches of ``global_batch``
    samples (its rows of each, in order): a per-replica stream, as ``split_dataset_by_node`` makes."""

    def __init__(self, n: int, shuffle: bool, global_batch: int, rank: int, replicas: int) -> None:
        super().__init__(n, shuffle)
        self.global_batch, self.rank, self.replicas = global_batch, rank, replicas

    def _order(self) -> list[int]:
        order, g = super()._order(), self.global_batch
        b = g // self.replicas
        mine = [order[k * g + self.rank * b + j] for k in range(len(order) // g) for j in range(b)]
        worker = torch.utils.data.get_worker_info()  # DataLoader workers: whole batches in turn, as it reads them
        if worker is not None:
            mine = [x for i, x in enumerate(mine) if (i // b) % worker.num_workers == worker.id]
        return mine


class ReplicaStreams(L.LightningDataModule):
    """Per-replica streams (mode "fixed layout"), built once the strategy knows this process's replica: each
    yields ``global_batch / D`` samples per step; together, :class:`StreamDataset`'s global batches."""

    def __init__(self, batch_size: int = 16, n: int = 64, shuffle: bool = False, num_workers: int = 0) -> None:
        super().__init__()
        self.batch_size, self.n, self.shuffle, self.num_workers = batch_size, n, shuffle, num_workers

    def train_dataloader(self) -> DataLoader:
        from lightning_spot.data.streams import fixed_layout

        replica = self.trainer.strategy.distributed_sampler_kwargs  # {"num_replicas": D, "rank": replica index}
        d, rank = replica["num_replicas"], replica["rank"]
        stream = ReplicaStream(self.n, self.shuffle, self.batch_size, rank, d)
        return fixed_layout(DataLoader(stream, batch_size=self.batch_size // d, num_workers=self.num_workers))


def make_loader(
    batch_size: int = 16,
    n: int = 64,
    shuffle: bool = False,
    dict_batches: bool = False,
    tokens: bool = False,
    padded: str = "",
    stream: bool | str = False,
    litdata: str = "",
    passes: list[list[int]] | None = None,
    container: str = "",
    user_sampler: bool = False,
    random_draws: bool = False,
    **kwargs: Any,
) -> DataLoader:
    if user_sampler:  # make_dataset(n) through the user's own DistributedSampler (a LightningDataModule)
        return UserSamplerData(batch_size, n)  # type: ignore[return-value]
    if random_draws:  # RandomCrops drawn by a WeightedRandomSampler (both draw from the process's generators)
        weights = torch.linspace(0.1, 1.0, n)
        return DataLoader(RandomCrops(n), batch_size=batch_size, sampler=WeightedRandomSampler(weights, n), **kwargs)
    if (
        container
    ):  # batches of make_dataset(n)'s (x, y) in a container type: "BatchEncoding" (transformers) or "dataclass"
        return DataLoader(make_dataset(n), batch_size=batch_size, collate_fn=ContainerCollate(container), **kwargs)
    if passes:  # make_dataset(n)'s samples, pass k in the order passes[k] (a LitData run's, for its reference)
        return DataLoader(OrderedPasses(n, passes), batch_size=batch_size, **kwargs)
    if litdata:  # a LitData StreamingDataLoader over tests.litdata_data.write_litdata's chunks (sharded mode)
        from tests.litdata_data import litdata_loader

        return litdata_loader(litdata, batch_size, shuffle=shuffle, **kwargs)  # type: ignore[no-any-return]
    if stream == "fixed":  # per-replica streams (a LightningDataModule: a replica's stream needs its index)
        return ReplicaStreams(batch_size, n, shuffle, **kwargs)  # type: ignore[return-value]
    if stream:  # an IterableDataset with a position (global-stream mode)
        return DataLoader(StreamDataset(n, shuffle), batch_size=batch_size, **kwargs)
    if padded:  # padded fine-tuning batches (dicts) for tests.hf_models.FineTune: "sft", "mlm" or "classify"
        from tests.hf_models import padded_dataset

        return DataLoader(padded_dataset(padded, n), batch_size=batch_size, shuffle=shuffle, **kwargs)  # type: ignore[arg-type]
    if tokens:  # token ids for the Hugging Face models of tests.hf_models
        from tests.hf_models import token_dataset

        dataset: Any = token_dataset(n)
    else:
        dataset = DictDataset(n) if dict_batches else make_dataset(n)
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, **kwargs)


def make_model(seed: int = 7, cls: str = "TinyPipelineModel", **kwargs: Any) -> L.LightningModule:
    torch.manual_seed(seed)
    if cls in ("CausalLM", "FineTune", "Preference", "LoRA", "Sampling"):
        import tests.hf_models

        return getattr(tests.hf_models, cls)(**kwargs)
    return globals()[cls](**kwargs)


class MetaInitPipelineModel(TinyPipelineModel):
    """The same network, but built in ``configure_model`` (on the meta device under spot_pipeline)."""

    def __init__(self, num_layers: int = 4, optimizer: str = "adam", lr: float = 0.05, scheduler: bool = False) -> None:
        L.LightningModule.__init__(self)
        self.save_hyperparameters({"num_layers": num_layers, "optimizer": optimizer, "lr": lr, "scheduler": scheduler})
        self.num_layers = num_layers

    def configure_model(self) -> None:
        if hasattr(self, "layers"):
            return
        self.embed = nn.Linear(IN, HIDDEN)
        self.layers = nn.Sequential(*[Block(HIDDEN) for _ in range(self.num_layers)])
        self.head = nn.Linear(HIDDEN, OUT)


class TiedEmbeddingModel(TinyPipelineModel):
    """Input projection and output projection share one weight (tied across the first and last stage)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.embed = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Linear(HIDDEN, HIDDEN, bias=False))
        self.head = nn.Sequential(nn.Linear(HIDDEN, HIDDEN, bias=False), nn.Linear(HIDDEN, OUT))
        self.head[0].weight = self.embed[1].weight


class ExampleInputModel(TiedEmbeddingModel):
    """Sets ``example_input_array``, as Lightning's tutorials do: the model summary runs it through the model."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.example_input_array = torch.zeros(2, IN)


class RecordSummary(ModelSummary):
    """Lightning's model summary, kept (``table``: the columns it prints, ``totals``) instead of printed."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        summary = self._summary(trainer, pl_module)
        self.table = dict(summary._get_summary_data())
        self.totals = [summary.total_parameters, summary.trainable_parameters, summary.total_flops]


class RecordWriter(BasePredictionWriter):
    """A prediction writer that keeps what it is given to write (per batch and at the epoch's end) instead."""

    def __init__(self) -> None:
        super().__init__(write_interval="batch_and_epoch")
        self.batches: list[tuple[list[int], torch.Tensor]] = []
        self.epochs: list[tuple[list[list[int]], list[torch.Tensor]]] = []

    def write_on_batch_end(self, trainer: Any, pl_module: Any, prediction: Any, batch_indices: Any, *args: Any) -> None:
        self.batches.append((list(batch_indices or []), prediction.detach().cpu()))

    def write_on_epoch_end(self, trainer: Any, pl_module: Any, predictions: Any, batch_indices: Any) -> None:
        self.epochs.append(([list(b) for b in batch_indices[0]], [p.detach().cpu() for p in predictions]))


class NoLayersModel(L.LightningModule):
    """A model whose blocks are not in a layer sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class HeadBeforeLayersModel(TinyPipelineModel):
    """Registers its head before the layer sequence, so it lands on the wrong stage."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.save_hyperparameters({"num_layers": 4, "optimizer": "adam", "lr": 0.05, "scheduler": False})
        self.head = nn.Linear(HIDDEN, OUT)
        self.embed = nn.Linear(IN, HIDDEN)
        self.layers = nn.Sequential(*[Block(HIDDEN) for _ in range(4)])


class ManualOptimModel(TinyPipelineModel):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class TinyDataModule(L.LightningDataModule):
    """The tests' regression data as a DataModule (for LightningCLI configs)."""

    def __init__(self, batch_size: int = 16, n: int = 64) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.n = n

    def train_dataloader(self) -> DataLoader:
        return make_loader(batch_size=self.batch_size, n=self.n)


class SaveFinalState(L.Callback):
    """Saves every rank's parameters at the end of fit (used to check CLI runs)."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = dirpath

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import os

        os.makedirs(self.dirpath, exist_ok=True)
        torch.save(
            {
                "state_dict": pl_module.state_dict(),
                "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            },
            os.path.join(self.dirpath, f"rank{trainer.global_rank}.pt"),
        )


class ReportSetup(L.Callback):
    """Writes every rank's process setup when training starts: threads, where they came from, OMP_NUM_THREADS."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = dirpath

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import json
        import os

        setup = getattr(trainer.strategy, "thread_setup", None)
        os.makedirs(self.dirpath, exist_ok=True)
        report = {
            "threads": torch.get_num_threads(),
            "source": setup.source if setup is not None else None,
            "host_malloc": getattr(getattr(trainer.strategy, "host_malloc", None), "applied", None),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", trainer.num_devices)),
        }
        with open(os.path.join(self.dirpath, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(report, f)


class LossHookModel(TinyPipelineModel):
    """Batches are dicts and training_step does not follow the contract; the loss hooks do."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.pipeline_loss(self.layers_free_forward(batch["x"]), batch)
        return loss

    def layers_free_forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.embed(x))
        for layer in self.layers:  # indexes the sequence itself instead of calling self(x)
            h = layer(h)
        return self.head(h)

    def pipeline_inputs(self, batch: dict) -> tuple[torch.Tensor]:
        return (batch["x"],)

    def pipeline_loss(self, output: torch.Tensor, batch: dict) -> torch.Tensor:
        loss = F.mse_loss(output, batch["y"])
        self.log("train_loss", loss)
        return loss


class DictDataset(torch.utils.data.Dataset):
    def __init__(self, n: int = 64) -> None:
        self.inner = make_dataset(n)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> dict:
        x, y = self.inner[i]
        return {"x": x, "y": y}


@dataclass
class XYBatch:
    """A batch as a dataclass (read by key, like a dict)."""

    x: torch.Tensor
    y: torch.Tensor

    def __getitem__(self, key: str) -> torch.Tensor:
        return getattr(self, key)  # type: ignore[no-any-return]


class ContainerCollate:
    """Collates ``(x, y)`` samples into a container that is not a dict: a tokenizer's ``BatchEncoding`` (what
    transformers' data collators return), or :class:`XYBatch`."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __call__(self, samples: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        x, y = (torch.stack([s[i] for s in samples]) for i in (0, 1))
        if self.kind == "BatchEncoding":
            from transformers import BatchEncoding

            return BatchEncoding({"x": x, "y": y})
        return XYBatch(x, y)


class ContainerBatchModel(TinyPipelineModel):
    """Reads its batches by key (``batch["x"]``): dicts, or the containers of :class:`ContainerCollate`."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step((batch["x"], batch["y"]), batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        super().validation_step((batch["x"], batch["y"]), batch_idx)


class UnevenPipelineModel(TinyPipelineModel):
    """Six layers, the first one far more expensive than the rest (cost-balanced cuts isolate it)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(num_layers=6, **kwargs)
        self.layers[0] = Block(HIDDEN, repeats=120)


class GradNormModel(TiedEmbeddingModel):
    """Logs its gradient norms before every update with ``lightning_spot.grad_norm`` (2-norms and infinity norms), as
    Lightning's documentation does with its own ``grad_norm``; the input and output projections share a weight."""

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        from lightning_spot import grad_norm

        self.log_dict(grad_norm(self, norm_type=2))
        self.log_dict(grad_norm(self, norm_type="inf"))


class BackboneModel(TinyPipelineModel):
    """Fine-tuning as Lightning's ``BackboneFinetuning`` expects it: a ``backbone`` (here the input projection) frozen
    until an epoch, then trained in a parameter group of its own; the optimizer takes the trainable parameters."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.backbone = self.embed
        del self.embed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(torch.relu(self.backbone(x))))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.hparams.lr, momentum=0.9)


class OutputsModel(TinyPipelineModel):
    """Returns its predictions with the loss (and from validation steps), as Lightning users do to read them in
    ``on_train_batch_end`` (``on_validation_batch_end``), and logs what it reads there: their mean and row count (the
    global batch's in one process)."""

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        preds = self(x)
        loss = F.mse_loss(preds, y)
        self.log("train_loss", loss)
        return {"loss": loss, "preds": preds.detach()}

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.log("preds_mean", outputs["preds"].mean())
        self.log("preds_rows", float(outputs["preds"].shape[0]))

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        preds = self(x)
        self.log("val_loss", F.mse_loss(preds, y))
        return {"preds": preds}

    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.log("val_preds_mean", outputs["preds"].mean())
        self.log("val_preds_rows", float(outputs["preds"].shape[0]), reduce_fx="max")


class MetricModel(TinyPipelineModel):
    """Logs torchmetrics objects as Lightning users do: R^2 (not a mean over samples, so a step's value is not the
    mean of its micro-batches' values) on steps and epochs in training, MSE and R^2 per epoch in validation; and a
    mean absolute error computed by hand at the validation epoch's end (``compute()``, logged, ``reset()``)."""

    def __init__(self, **kwargs: Any) -> None:
        import torchmetrics

        super().__init__(**kwargs)
        self.train_r2 = torchmetrics.R2Score()
        self.val_mse = torchmetrics.MeanSquaredError()
        self.val_r2 = torchmetrics.R2Score()
        self.val_mae = torchmetrics.MeanAbsoluteError()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        loss = F.mse_loss(out, y)
        self.train_r2(out, y)
        self.log("train_r2", self.train_r2, on_step=True, on_epoch=True)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        out = self(x)
        self.val_mse(out, y)
        self.val_r2.update(out, y)  # update only: nothing to log on steps, compute() at the epoch's end
        self.log("val_mse", self.val_mse, prog_bar=True)
        self.log("val_r2", self.val_r2)
        self.log("val_loss", F.mse_loss(out, y))
        self.val_mae.update(out, y)

    def on_validation_epoch_end(self) -> None:
        self.log("val_mae", self.val_mae.compute())  # (on every rank: the last stages' value, synced over them)
        self.val_mae.reset()


class TrainMetricModel(TinyPipelineModel):
    """Logs torchmetrics objects in training only, the plainest shape users write: ``self.mse(out, y)`` and
    ``self.log("train_mse", self.mse, on_step=True, on_epoch=True)`` (and R^2, which needs two samples to be
    computed), no ``validation_step`` at all."""

    validation_step = L.LightningModule.validation_step  # (none: Lightning runs no validation loop)

    def __init__(self, **kwargs: Any) -> None:
        import torchmetrics

        super().__init__(**kwargs)
        self.mse = torchmetrics.MeanSquaredError()
        self.r2 = torchmetrics.R2Score()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        loss = F.mse_loss(out, y)
        self.mse(out, y)
        self.r2(out, y)
        self.log("train_mse", self.mse, on_step=True, on_epoch=True)
        self.log("train_r2", self.r2, on_step=True, on_epoch=True)
        self.log("train_loss", loss)
        return loss


class SummedLossModel(TinyPipelineModel):
    """Losses summed over the batch's samples (``reduction="sum"``, as the classic VAE example): the squared error
    returned as it is (``"returned"``, recognised); plus a penalty summed over the samples and said to be a sum
    (``"declared"``: ``loss_reduction``); or that, not said (``"undeclared"``: taken for a mean, with a warning).
    Validation logs the summed squared error. Trained with SGD (Adam would not see the loss's scale)."""

    def __init__(self, kind: str = "returned", **kwargs: Any) -> None:
        super().__init__(**{"optimizer": "sgd", "lr": 0.002, **kwargs})
        self.kind = kind

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        out = self(x)
        loss = nn.MSELoss(reduction="sum")(out, y)
        if self.kind != "returned":
            loss = loss + 0.01 * out.pow(2).sum()
        self.log("train_loss", loss)
        return {"loss": loss, "loss_reduction": "sum"} if self.kind == "declared" else loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y, reduction="sum"))


class CollectingModel(TinyPipelineModel):
    """Collects step outputs in lists for the epoch's end, as Lightning 2's documentation shows: the batch index
    (appended before the forward), the loss per step, per-sample predictions in a dict of lists (one per
    dataloader, the list made in the step); logs what it computes from them at the epochs' ends."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.batch_indices: list[int] = []
        self.train_losses: list[torch.Tensor] = []
        self.val_outputs: dict[str, list[dict[str, torch.Tensor]]] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.batch_indices.append(batch_idx)
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.train_losses.append(loss.detach())
        self.log("train_loss", loss)
        return loss

    def on_train_epoch_end(self) -> None:
        self.log("epoch_mean_loss", torch.stack(self.train_losses).mean())
        self.log("epoch_steps", float(len(self.train_losses)))
        self.log("epoch_batch_indices", float(sum(self.batch_indices) + 100 * len(self.batch_indices)))
        self.train_losses.clear()
        self.batch_indices.clear()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        preds = self(x)
        self.val_outputs.setdefault("val", []).append({"preds": preds, "y": y})
        self.log("val_loss", F.mse_loss(preds, y))

    def on_validation_epoch_end(self) -> None:
        outputs = self.val_outputs.pop("val")
        preds, ys = (torch.cat([o[k] for o in outputs]) for k in ("preds", "y"))
        self.log("val_mse_all", F.mse_loss(preds, ys))
        self.log("val_rows", float(len(preds)) + 100 * len(outputs))


class Overflow(L.Callback):
    """Puts an inf into one gradient element of parameter ``param`` after the backward of step ``step``, on the
    ranks holding it in data-parallel replica ``replica`` (a single process holds every parameter)."""

    def __init__(self, param: str, step: int, replica: int = 0) -> None:
        self.param, self.step, self.replica = param, step, replica

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        replica = engine.ctx.dp_rank if engine is not None else self.replica  # one process: every replica
        param = dict(pl_module.named_parameters()).get(self.param)
        if trainer.global_step == self.step and replica == self.replica and param is not None:
            assert param.grad is not None
            param.grad.view(-1)[0] = float("inf")


def lightning_callbacks(scenario: dict[str, Any]) -> list[L.Callback]:
    """Lightning's own callbacks a scenario asks for (the same in the pipelined run and in its reference):
    ``swa`` (``StochasticWeightAveraging``'s arguments), ``finetune`` (``BackboneFinetuning``'s), ``ema``
    (``EMAWeightAveraging``'s decay), ``summary`` (the model summary, kept: :class:`RecordSummary`), ``writer``
    (a prediction writer: :class:`RecordWriter`)."""
    from lightning.pytorch.callbacks import BackboneFinetuning, EMAWeightAveraging, StochasticWeightAveraging

    callbacks: list[L.Callback] = []
    if "swa" in scenario:
        callbacks.append(StochasticWeightAveraging(**scenario["swa"]))
    if "finetune" in scenario:
        callbacks.append(BackboneFinetuning(**scenario["finetune"]))
    if "ema" in scenario:
        callbacks.append(EMAWeightAveraging(decay=scenario["ema"]))
    if scenario.get("summary"):
        callbacks.append(RecordSummary())
    if scenario.get("writer"):
        callbacks.append(RecordWriter())
    return callbacks


def fit_in_this_process(
    root: Any, model: L.LightningModule, data: Any, keep_process_group: bool = False, **trainer_kwargs: Any
) -> L.Trainer:
    """Fit ``model`` with ``spot_pipeline`` on one CPU device in the test's own process (P1xD1, quiet); the
    environment and thread pool that the strategy sizes (``OMP_NUM_THREADS``) are restored afterwards, so later
    tests' processes do not inherit them, and its process group (of one) is destroyed (unless
    ``keep_process_group``: as after a plain Lightning fit, for the next fit in the process)."""
    import os

    from lightning_spot import SpotPipelineStrategy

    trainer = L.Trainer(
        **{
            "strategy": SpotPipelineStrategy(pipeline_stages=1),
            "devices": 1,
            "accelerator": "cpu",
            "default_root_dir": root,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            **trainer_kwargs,
        }
    )
    env, threads = dict(os.environ), torch.get_num_threads()
    try:
        trainer.fit(model, data)
    finally:
        os.environ.clear()
        os.environ.update(env)
        torch.set_num_threads(threads)
        if torch.distributed.is_initialized() and not keep_process_group:  # (later tests start without it)
            torch.distributed.destroy_process_group()
    return trainer
