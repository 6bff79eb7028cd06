"""Entries a step's micro-batches append to the module's lists, merged into what one process appends."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from torch import nn

from lightning_spot.replay.module_lists import lengths_kept, lists_kept
from lightning_spot.runtime.step_appends import StepAppends, merge_micro_batches


class Pair(NamedTuple):
    preds: torch.Tensor
    index: int


def test_micro_batch_values_merge_as_one_batch_s() -> None:
    rows = [3, 1]
    a, b = torch.randn(3, 2), torch.randn(1, 2)
    assert torch.equal(merge_micro_batches([a, b], rows), torch.cat([a, b]))  # per-sample: concatenated
    mean = merge_micro_batches([torch.tensor(2.0), torch.tensor(6.0)], rows)  # a mean over samples
    assert float(mean) == pytest.approx(3.0)
    assert merge_micro_batches([2.0, 6.0], rows) == pytest.approx(3.0)
    assert merge_micro_batches([7, 7], rows) == 7 and merge_micro_batches(["x", "x"], rows) == "x"  # the same: once
    assert merge_micro_batches([1, 2], rows) == [1, 2]  # differing numbers that are not floats: listed
    merged = merge_micro_batches([Pair(a, 5), Pair(b, 5)], rows)
    assert isinstance(merged, Pair) and torch.equal(merged.preds, torch.cat([a, b])) and merged.index == 5
    nested = merge_micro_batches([{"p": a, "n": (a[:, 0], 1)}, {"p": b, "n": (b[:, 0], 1)}], rows)
    assert torch.equal(nested["p"], torch.cat([a, b])) and torch.equal(nested["n"][0], torch.cat([a, b])[:, 0])
    w = torch.ones(2)  # not per-sample (a row of weights): the same in both, kept once
    assert merge_micro_batches([w, w.clone()], rows) is w


class Lists(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = [0.5]
        self.by_loader: dict[str, list[torch.Tensor]] = {}
        self._private: list[int] = []


def test_the_last_stage_s_merged_entries_replace_every_rank_s() -> None:
    torch.manual_seed(0)
    last, first = Lists(), Lists()
    ends, starts = StepAppends(last), StepAppends(first)
    ends.before()
    starts.before()
    parts = [torch.randn(2, 3), torch.randn(2, 3)]
    for part in parts:  # the last stage runs the step once per micro-batch
        last.losses += [float(part.sum()), 1.0]  # two appends per micro-batch
        last.by_loader.setdefault("val", []).append(part)
        last._private.append(1)
    first.losses.append(9.0)  # (code before the forward ran on the first stage too)
    taken = ends.take([2, 2])
    assert taken is not None and set(taken) == {("losses", None), ("by_loader", "val")}
    for appends in (ends, starts):
        appends.put(taken)
    for m in (last, first):
        assert m.losses[0] == 0.5 and m.losses[1] == pytest.approx(float(torch.cat(parts).sum()) / 2, abs=1e-5)
        assert m.losses[2] == 1.0 and len(m.losses) == 3
        (val,) = m.by_loader["val"]
        assert torch.equal(val, torch.cat(parts))
    assert last._private == [1, 1] and first._private == [], "private attributes are the module's own business"
    ends.before()
    last.losses += [1.0, 2.0, 3.0]  # not one per micro-batch: kept as appended
    assert ends.take([2, 2]) == {("losses", None): [1.0, 2.0, 3.0]}
    ends.before()
    assert ends.take([2, 2]) is None


def test_a_throw_away_run_leaves_no_entries() -> None:
    m = Lists()
    m.by_loader["val"] = [torch.zeros(1)]
    with lists_kept(m):
        m.losses.append(1.0)
        m.by_loader["val"].append(torch.ones(1))
    assert m.losses == [0.5] and len(m.by_loader["val"]) == 1


def test_a_step_undone_leaves_no_entries() -> None:
    """(torchft runs a step that did not commit again: what it appended is dropped first)"""
    m = Lists()
    undo = lengths_kept(m)
    m.losses.append(2.0)
    m.by_loader["new"] = [torch.ones(1)]  # (a list made in the step stays, emptied)
    undo()
    assert m.losses == [0.5] and m.by_loader == {"new": []}
