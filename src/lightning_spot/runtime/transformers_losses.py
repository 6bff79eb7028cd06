"""The items a transformers model's own loss function averages over, read from the call it really makes.

    calls = LossCalls(model)
    calls.start()                                  # before the model's forward (a forward pre-hook does this)
    output = model(input_ids=ids, labels=labels)
    calls.stop()                                   # after it (a forward hook, always called)
    count = calls.count()                          # a tensor, or None: no call, several, or a loss not known here

transformers models compute their loss through ``self.loss_function``: the function its ``loss_type`` names in
``LOSS_MAPPING``, and ``ForCausalLMLoss`` when the type is ``None`` or unknown (``GPT2LMHeadModel`` and every other
``*LMHeadModel``, whose class names match no type). Rather than foresee that choice from the class, the call is
watched: for the time of the model's forward, ``loss_function`` is a wrapper that calls the function transformers
chose and counts what it averaged over, from the arguments it got:

* causal LM (``ForCausalLMLoss``): the labels after the first position (or ``shift_labels``) that are not the
  ignore index;
* masked LM, token classification: the labels that are not the ignore index;
* sequence classification: one per sample (its label not -100), or every label value for regression and
  multi-label problems (a mean over all of them).

A loss given ``num_items_in_batch`` is a sum divided by that number, not a mean over its own items: not counted.
A model that computes its loss without ``loss_function`` (``BertForMaskedLM``'s own ``CrossEntropyLoss``) is
counted by its ``loss_type`` when it has one of the types above; otherwise (``GPT2DoubleHeadsModel``) it is not,
and the step runner's watch of cross-entropy losses warns if the mean was over targets holding an ignore index.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from torch import Tensor, nn

IGNORE_INDEX = -100
_ABSENT = object()


def _loss_utils() -> Any:
    """transformers' module of loss functions, if transformers was imported (a model exists only then)."""
    return sys.modules.get("transformers.loss.loss_utils")


def loss_call_items(function: Callable, args: tuple, kwargs: dict[str, Any]) -> Tensor | None:
    """The number of items transformers' loss ``function`` averaged over when called with ``args`` and ``kwargs``
    (after the call: sequence classification settles its problem type in it); ``None`` when not known."""
    utils = _loss_utils()
    if utils is None:
        return None
    try:
        bound = inspect.signature(function).bind(*args, **kwargs).arguments
    except TypeError:
        return None
    extra = bound.get("kwargs", {})
    if bound.get("num_items_in_batch", extra.get("num_items_in_batch")) is not None:
        return None  # a sum divided by a count given from outside
    labels = bound.get("labels")
    if not isinstance(labels, Tensor):
        return None
    ignore = bound.get("ignore_index", extra.get("ignore_index", IGNORE_INDEX))
    if function is getattr(utils, "ForCausalLMLoss", _ABSENT):
        shifted = bound.get("shift_labels")
        target = shifted if isinstance(shifted, Tensor) else labels[..., 1:]  # position t predicts token t + 1
        return (target != ignore).sum()
    if function in (getattr(utils, "ForMaskedLMLoss", _ABSENT), getattr(utils, "ForTokenClassification", _ABSENT)):
        return (labels != ignore).sum()
    if function is getattr(utils, "ForSequenceClassificationLoss", _ABSENT):
        problem = getattr(bound.get("config"), "problem_type", None)
        if problem in ("regression", "multi_label_classification"):  # a mean over every label value
            return torch.full((), labels.numel(), device=labels.device)  # (a fill: a copy would wait for the device)
        if problem == "single_label_classification":
            return (labels != ignore).sum()
    return None


def loss_type_items(model: nn.Module, kwargs: Mapping[str, Any]) -> Tensor | None:
    """The number of items the loss of transformers ``model`` averages over when called with ``kwargs``, by its
    ``loss_type`` (``None``: no labels, or a loss this rule does not know): for models that compute their loss
    without ``loss_function`` (``BertForMaskedLM``'s own ``CrossEntropyLoss``)."""
    labels = kwargs.get("labels")
    if not isinstance(labels, Tensor):
        return None
    loss_type = getattr(model, "loss_type", None)
    if loss_type in ("ForCausalLM", "ForConditionalGeneration"):
        shifted = kwargs.get("shift_labels")
        target = shifted if isinstance(shifted, Tensor) else labels[..., 1:]  # position t predicts token t + 1
        return (target != IGNORE_INDEX).sum()
    if loss_type in ("ForMaskedLM", "ForTokenClassification"):
        return (labels != IGNORE_INDEX).sum()
    if loss_type in (
        "ForSequenceClassification",
        "ForImageClassification",
        "ForAudioClassification",
        "ForVideoClassification",
    ):
        if labels.is_floating_point():  # regression or multi-label: a mean over every label value
            return torch.full((), labels.numel(), device=labels.device)  # (a fill: a copy would wait for the device)
        return (labels != IGNORE_INDEX).sum()
    return None


class LossCalls:
    """For the time between :meth:`start` and :meth:`stop` (one forward of ``model``), ``model.loss_function`` counts
    the items of each call it makes (see the module's text)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        #: the counts of the calls made since :meth:`start` (``None``: a call not counted)
        self.counts: list[Tensor | None] = []
        #: the count the model's ``loss_type`` gives, for a forward that calls no loss function
        self.by_type: Tensor | None = None
        self._own: Any = _ABSENT

    def start(self, kwargs: Mapping[str, Any]) -> None:
        """(Before the forward, called with ``kwargs``.)"""
        self.counts, self.by_type = [], loss_type_items(self.model, kwargs)
        self._own = self.model.__dict__.get("_loss_function", _ABSENT)  # (transformers' setter keeps one there)
        self.model.__dict__["_loss_function"] = self._counting

    def stop(self) -> None:
        if self._own is _ABSENT:
            self.model.__dict__.pop("_loss_function", None)
        else:
            self.model.__dict__["_loss_function"] = self._own

    def count(self) -> Tensor | None:
        """The items of the model's loss: those of its one call of a loss function this module knows, or by its loss
        type if it called none."""
        if not self.counts:
            return self.by_type
        return self.counts[0] if len(self.counts) == 1 else None

    def _chosen(self) -> Callable:
        """The loss function transformers gives the model (read when called: for a model without a loss type it
        logs that it takes the causal-LM loss, as it does without this watch)."""
        if self._own is not _ABSENT:
            return self._own
        self.stop()
        try:
            return cast(Callable, self.model.loss_function)
        finally:
            self.model.__dict__["_loss_function"] = self._counting

    def _counting(self, *args: Any, **kwargs: Any) -> Any:
        function = self._chosen()
        loss = function(*args, **kwargs)
        self.counts.append(loss_call_items(function, args, kwargs))
        return loss
