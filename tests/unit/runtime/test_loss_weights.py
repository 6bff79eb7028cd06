"""Losses that are means over a varying number of items: what counts as an item, and how micro-batches combine."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import default_collate

from lightning_spot import ModelContractError
from lightning_spot.runtime.item_counts import ItemCounts
from lightning_spot.runtime.loss_weights import LossWeights

#: every family of docs/huggingface.md's table: GPT-2's loss type is None (transformers takes the causal-LM loss);
#: BERT's heads compute their loss with their own CrossEntropyLoss (counted by loss type); Llama's classification
#: head calls transformers' sequence-classification loss
CASES = [
    ("gpt2", "causal", "sft"),
    ("llama", "causal", "sft"),
    ("qwen2", "causal", "sft"),
    ("opt", "causal", "sft"),
    ("bert", "masked", "mlm"),
    ("bert", "classify", "classify"),
    ("llama", "classify", "classify"),
]


def _counted(model: torch.nn.Module, batch: dict[str, Tensor], **extra: Any) -> tuple[Any, Tensor | None]:
    """The model's output on ``batch`` and the count ItemCounts gives its loss, as the step runner asks for it."""
    counts, before = ItemCounts(model), model.__dict__.get("_loss_function")
    with torch.no_grad(), counts.micro_batch(watch=True):
        out = model(**batch, **extra)
    assert model.__dict__.get("_loss_function") is before, "the watch of the loss function is gone after the forward"
    return out, counts.count_of(out.loss, out.loss)


@pytest.mark.parametrize(("family", "kind", "task"), CASES, ids=lambda v: v)
def test_the_count_is_what_the_models_loss_averages_over(family: str, kind: str, task: str) -> None:
    """The model's own loss, summed over its items, divided by the count, is its mean loss."""
    pytest.importorskip("transformers")
    from tests.hf_models import fine_tune_model, padded_dataset

    model = fine_tune_model(family, kind, tied=True)
    batch = default_collate(padded_dataset(task, 4))
    out, count = _counted(model, batch)
    assert count is not None
    logits, labels = out.logits.flatten(0, -2), batch["labels"]
    if kind == "causal":  # position t predicts token t + 1
        logits, labels = out.logits[:, :-1].flatten(0, 1), labels[:, 1:]
    total = F.cross_entropy(logits, labels.flatten(), ignore_index=-100, reduction="sum")
    assert (total / count).item() == pytest.approx(out.loss.item(), rel=1e-6)
    assert int(count) < labels.numel() or kind == "classify", "the test data must mask some labels"


def test_losses_the_rule_cannot_tell_have_no_count() -> None:
    """A loss divided by a count given from outside (``num_items_in_batch``), a loss function of the user's, a head
    that computes its loss without transformers' loss functions and has no loss type (GPT-2's double heads): no
    count (the step runner warns about a mean over ignored targets); a regression head counts every value."""
    pytest.importorskip("transformers")
    import transformers

    from tests.hf_models import fine_tune_model, hf_config, padded_dataset

    batch = default_collate(padded_dataset("sft", 4))
    model = fine_tune_model("gpt2", "causal")
    assert _counted(model, batch, num_items_in_batch=torch.tensor(7))[1] is None

    def own(logits: Tensor, labels: Tensor, vocab_size: int, **kwargs: Any) -> Tensor:
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())

    model.loss_function = own
    assert _counted(model, batch)[1] is None
    assert model.loss_function is own, "the user's loss function is back in place"

    double = transformers.GPT2DoubleHeadsModel(hf_config("gpt2", tied=True))
    assert double.loss_type is None
    assert _counted(double, {"input_ids": batch["input_ids"], "labels": batch["labels"]})[1] is None

    regression = fine_tune_model("llama", "classify")
    regression.config.num_labels, regression.score = 1, torch.nn.Linear(32, 1, bias=False)
    values = {"input_ids": batch["input_ids"], "labels": torch.randn(4)}
    assert int(_counted(regression, values)[1]) == 4  # type: ignore[arg-type]


def test_a_step_returning_the_models_loss_gets_its_count_and_a_declared_count_wins() -> None:
    pytest.importorskip("transformers")
    from tests.hf_models import fine_tune_model, padded_dataset

    model = fine_tune_model("llama", "causal")
    batch = default_collate(padded_dataset("sft", 2))
    counts = ItemCounts(model)
    with counts.micro_batch(watch=True):
        loss = model(**batch).loss
    assert int(counts.count_of(loss, loss)) == int((batch["labels"][:, 1:] != -100).sum())  # type: ignore[arg-type]
    assert counts.count_of(loss * 2, loss * 2) is None, "another loss than the model's has no known count"
    assert int(counts.count_of({"loss": loss, "num_items": 5}, loss)) == 5  # type: ignore[arg-type]
    assert counts.ignored_targets, "the model's cross-entropy ran over -100 labels"
    outside = model(**batch).loss  # not collecting: nothing recorded
    assert counts.count_of(outside, outside) is None


def _settle(parts: list[LossWeights], total: int) -> tuple[float, float, Any]:
    """What the engine does with every replica's records: sum them, then settle (on each rank alike)."""
    sums: dict[str, tuple[float, dict]] = {}
    for weights in parts:
        for record in weights.records():
            seen = sums.get(record.name, (0.0, {}))[0]
            value = (
                max(seen, float(record.value)) if record.options["reduce_fx"] == "max" else seen + float(record.value)
            )
            sums[record.name] = (value, record.options)
    return (*parts[0].settle(sums, total), sums)


def test_weighted_micro_batches_give_the_gradient_of_the_global_mean() -> None:
    """Two replicas x two micro-batches of per-token losses: what is back-propagated, times the factor, is the
    gradient of the mean over every token; an empty micro-batch (a NaN mean) adds nothing."""
    torch.manual_seed(0)
    w = torch.randn(3, requires_grad=True)
    tokens = [torch.randn(n, 3) for n in (5, 1, 0, 7)]  # the third micro-batch holds no labelled token
    reference = torch.cat([t @ w for t in tokens]).mean()
    (want,) = torch.autograd.grad(reference, w)

    replicas = [LossWeights(), LossWeights()]
    replicas[1].leads = False  # (the second of the last stages' group: the reference is added once)
    for weights in replicas:
        weights.reference = 4.0  # any reference count gives the same result
        weights.start()
    grad = torch.zeros(3)
    for i, t in enumerate(tokens):
        mean = (t @ w).mean()  # NaN for the empty one
        backed = replicas[i // 2].add(mean, torch.tensor(len(t)), samples=1)
        (g,) = torch.autograd.grad(backed, w)
        grad += g / 2 / 2  # the schedule's mean over 2 micro-batches, DDP's over 2 replicas
    value, factor, _ = _settle(replicas, total=4)
    assert value == pytest.approx(reference.item(), rel=1e-6)
    assert torch.allclose(grad * factor, want, atol=1e-6)
    assert replicas[0].reference == pytest.approx(13 / 4)
    fx = {r.options["reduce_fx"] for weights in replicas for r in weights.records()}
    assert fx == {"sum"}, "every record is a sum: one all-reduce over the last stages per step, none for a maximum"


def test_equal_counts_multiply_by_exactly_one() -> None:
    """Sequences without padding: what is back-propagated is the mean itself and the factor is 1, so the
    arithmetic is that of unweighted losses (the first reference is the first count)."""
    weights = LossWeights()
    for _ in range(2):
        weights.start()
        backed = [weights.add(torch.tensor(v), torch.tensor(30), samples=2) for v in (0.3, 0.7)]
        assert [b.item() for b in backed] == [torch.tensor(0.3).item(), torch.tensor(0.7).item()]
        assert _settle([weights], total=2)[1] == 1.0


def test_unweighted_losses_count_alike_and_a_mix_is_refused() -> None:
    weights = LossWeights()
    weights.start()
    for value in (1.0, 3.0):
        weights.add(torch.tensor(value), None, samples=2)
    value, factor, _ = _settle([weights], total=2)
    assert (value, factor) == (2.0, 1.0)
    weights.start()
    weights.add(torch.tensor(1.0), torch.tensor(3), samples=2)
    weights.add(torch.tensor(1.0), None, samples=2)
    with pytest.raises(ModelContractError, match="1 of this step's 2 micro-batches gave an item count.*num_items"):
        weights.records()


@pytest.mark.filterwarnings("ignore:size_average and reduce args")
def test_losses_summed_over_samples_are_noticed_only_when_summed() -> None:
    """Sums (however a loss function is asked for one) are kept; means, and a sum's later transforms, are not."""
    model = torch.nn.Linear(3, 2)
    x, y, labels = torch.randn(4, 3), torch.randn(4, 2), torch.tensor([0, 1, 1, 0])
    counts = ItemCounts(model)
    with counts.micro_batch(watch=True):
        out = model(x)
        sums = [
            torch.nn.MSELoss(reduction="sum")(out, y),
            F.cross_entropy(out, labels, reduction="sum"),
            F.l1_loss(out, y, size_average=False),  # (the legacy spelling of a sum)
        ]
        means = [F.mse_loss(out, y), F.cross_entropy(out, labels), F.mse_loss(out, y, reduction="none").sum(1).mean()]
        scaled = sums[0] / 4
    assert all(counts.summed(s) for s in sums) and not any(counts.summed(m) for m in (*means, scaled))
    assert not counts.plain()
    with counts.micro_batch(watch=False):  # not watched: nothing seen
        unseen = F.mse_loss(model(x), y, reduction="sum")
    assert not counts.summed(unseen) and counts.plain()


def test_summed_micro_batches_give_the_gradient_of_the_batch_sum() -> None:
    """Two replicas x two micro-batches of summed losses (uneven: 3, 1, 2 and 2 samples): their sum is the step's
    loss, and what is back-propagated (divided by the micro-batches and replicas), times the factor, is the gradient
    of the sum over the global batch. A mix with means, or with an item count, is refused."""
    torch.manual_seed(0)
    w = torch.randn(3, requires_grad=True)
    rows = [torch.randn(n, 3) for n in (3, 1, 2, 2)]
    reference = torch.cat([r @ w for r in rows]).pow(2).sum()
    (want,) = torch.autograd.grad(reference, w)
    replicas = [LossWeights(), LossWeights()]
    grad = torch.zeros(3)
    for weights in replicas:
        weights.start()
    for i, r in enumerate(rows):
        backed = replicas[i // 2].add((r @ w).pow(2).sum(), None, samples=len(r), summed=True)
        (g,) = torch.autograd.grad(backed, w)
        grad += g / 2 / 2
    value, factor, _ = _settle(replicas, total=4)
    assert value == pytest.approx(reference.item(), rel=1e-6) and factor == 4.0
    assert torch.allclose(grad * factor, want, atol=1e-5)

    weights = LossWeights()
    weights.start()
    weights.add(torch.tensor(1.0), None, samples=2, summed=True)
    weights.add(torch.tensor(1.0), None, samples=2)
    with pytest.raises(ModelContractError, match="1 of this step's 2 micro-batches returned a loss summed"):
        weights.records()
    with pytest.raises(ModelContractError, match="both an item count .* and a loss summed"):
        weights.add(torch.tensor(1.0), torch.tensor(3), samples=2, summed=True)


def test_a_step_says_what_its_loss_is_and_a_logged_sum_is_summed_from_then_on() -> None:
    from lightning_spot.runtime.logging_bridge import LogRecord, PackedLogs
    from lightning_spot.runtime.summed_losses import SummedLosses

    model = torch.nn.Linear(3, 2)
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    counts, sums = ItemCounts(model), SummedLosses()
    with counts.micro_batch(watch=True):
        total = F.mse_loss(model(x), y, reduction="sum")
    vae = total + 1.0
    assert sums.loss_is_sum({"loss": vae, "loss_reduction": "sum"}, vae, counts)
    assert not sums.loss_is_sum({"loss": vae, "loss_reduction": "mean"}, vae, counts)
    with pytest.raises(ModelContractError, match="loss_reduction='avg'.*'sum' or 'mean'"):
        sums.loss_is_sum({"loss": vae, "loss_reduction": "avg"}, vae, counts)
    with pytest.warns(UserWarning, match="loss_reduction"):  # a sum was computed, another tensor returned
        assert not sums.loss_is_sum(vae, vae, counts)
        sums.warn_unsure()
    assert sums.loss_is_sum(total, total, counts) and sums.loss_is_sum(vae, vae, ItemCounts(model)), "remembered"

    def records(logged: Tensor) -> list[LogRecord]:
        return [LogRecord("sse", logged.detach(), 2.0, {}, id(logged)), LogRecord("mse", logged.detach(), 2.0, {})]

    first = records(total)
    sums.mark("validation_step", first, counts)  # (the watched micro-batch: "sse" is the summed tensor)
    later = records(torch.tensor(3.0))
    sums.mark("validation_step", later, ItemCounts(model))  # not watched: by name
    packed = PackedLogs(first + later, torch.device("cpu")).values()
    assert packed["sse"][0] == pytest.approx(total.item() + 3.0) and packed["sse"][1] == {}
    assert packed["mse"][0] == pytest.approx((total.item() + 3.0) / 2)
