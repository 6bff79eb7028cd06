"""Draws from generators seeded by a key leave the process's own generators as they were."""

from __future__ import annotations

import random

import numpy as np
import torch

from lightning_spot.replay.draws import draw_key, reseed, seeded_draws


def _draw() -> tuple[float, float, float]:
    return float(torch.rand(())), random.random(), float(np.random.rand())


def test_the_same_key_draws_the_same_and_the_process_goes_on_as_before() -> None:
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    undisturbed = [_draw(), _draw()]
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    first = _draw()
    with seeded_draws(draw_key(3, 4)):
        inside = _draw()
    torch.manual_seed(99), random.seed(99), np.random.seed(99)  # another process state: the same draws inside
    with seeded_draws(draw_key(3, 4)):
        assert _draw() == inside
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    _draw()
    with seeded_draws(draw_key(3, 5)):
        assert _draw() != inside  # another key, other draws
    assert [first, _draw()] == undisturbed  # the process's draws did not notice


def test_torch_only_leaves_python_and_numpy_to_the_process() -> None:
    random.seed(2), np.random.seed(2)
    expected = random.random(), float(np.random.rand())
    random.seed(2), np.random.seed(2)
    with seeded_draws(7, python=False):
        got = random.random(), float(np.random.rand())  # the process's own streams, advanced
        a = torch.rand(3)
        reseed(draw_key(7, 1))  # another stream from here on in the block (a stage's layers)
        b = torch.rand(3)
    assert got == expected
    with seeded_draws(7, python=False):
        assert torch.equal(torch.rand(3), a)
    with seeded_draws(draw_key(7, 1), python=False):
        assert torch.equal(torch.rand(3), b) and not torch.equal(a, b)
