"""Random draws from generators seeded by a key, with the process's own generators put back afterwards.

    with seeded_draws(draw_key(seed, epoch, batch), python=True):   # torch's CPU generator, random, NumPy
        ...
    with seeded_draws(key, python=False, device=cuda):               # torch's CPU and that device's generators
        reseed(draw_key(key, 1), cuda)                               # another stream from here on in the block

Used where every rank of a pipeline must draw alike (the data it reads: ``_data_draws``; the code of the user's step
that each stage replays: ``runtime/step_runner``).
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator
from typing import Any

import torch

_MASK = (1 << 63) - 1


def draw_key(*parts: int) -> int:
    """One seed from several integers (a polynomial hash: the same on every process, unlike ``hash`` of a str)."""
    key = 0
    for part in parts:
        key = (key * 1_000_003 + int(part)) & _MASK
    return key


def _device_generator(device: torch.device | None) -> torch.Generator | None:
    if device is None or device.type != "cuda":
        return None
    torch.cuda.init()  # (the generators exist once CUDA is initialised; a no-op after that)
    return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]


def reseed(key: int, device: torch.device | None = None, *, python: bool = False) -> None:
    """Seed torch's CPU generator (and ``device``'s, on a GPU) from ``key``; with ``python`` also Python's ``random``
    and NumPy's global generator (if NumPy is imported), ~9 us more."""
    torch.default_generator.manual_seed(key)
    gpu = _device_generator(device)
    if gpu is not None:
        gpu.manual_seed(key)
    if python:
        random.seed(key)
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed(key % (1 << 32))


def python_states() -> tuple[Any, Any]:
    """The states of Python's ``random`` and of NumPy's global generator (None before NumPy is imported), for
    :func:`python_drew` (~35 us)."""
    numpy = sys.modules.get("numpy")
    return random.getstate(), numpy.random.get_state() if numpy is not None else None


def python_drew(before: tuple[Any, Any]) -> bool:
    """Whether Python's ``random`` or NumPy's global generator drew since ``before`` (:func:`python_states`)."""
    python, numpy = python_states()
    if python != before[0]:
        return True
    if numpy is None or before[1] is None:
        return numpy is not None and before[1] is None
    _, keys, position, gauss, _ = numpy
    _, keys_before, position_before, gauss_before, _ = before[1]
    return bool(position != position_before or gauss != gauss_before or (keys != keys_before).any())


@contextlib.contextmanager
def seeded_draws(key: int, *, python: bool = True, device: torch.device | None = None) -> Iterator[None]:
    """Run the block with torch's CPU generator (and ``device``'s, on a GPU) seeded from ``key``, and with ``python``
    also Python's ``random`` and NumPy's global generator (if NumPy is imported); their states come back afterwards.
    (torch's generators cost ~2 us; Python's and NumPy's ~80 us more.)"""
    cpu, gpu = torch.default_generator, _device_generator(device)
    numpy = sys.modules.get("numpy") if python else None
    saved_cpu = cpu.get_state()
    saved_gpu = gpu.get_state() if gpu is not None else None
    saved_python = random.getstate() if python else None
    saved_numpy = numpy.random.get_state() if numpy is not None else None
    reseed(key, device, python=python)
    try:
        yield
    finally:
        cpu.set_state(saved_cpu)
        if gpu is not None and saved_gpu is not None:
            gpu.set_state(saved_gpu)
        if saved_python is not None:
            random.setstate(saved_python)
        if numpy is not None:
            numpy.random.set_state(saved_numpy)
