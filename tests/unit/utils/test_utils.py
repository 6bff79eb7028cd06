"""The small helpers under ``utils``: byte sizes and divisors, collectives without a process group, the warnings
hidden where they arise."""

from __future__ import annotations

import warnings

import pytest

from lightning_spot.utils import distributed
from lightning_spot.utils.units import divisors, format_bytes, parse_bytes
from lightning_spot.utils.warnings import hide_inapplicable_warnings


def test_divisors_and_byte_sizes_both_ways() -> None:
    assert divisors(12) == [1, 2, 3, 4, 6, 12] and divisors(7) == [1, 7]
    assert parse_bytes("80GB") == 80e9 and parse_bytes("512 MiB") == 512 * 2**20 and parse_bytes("1kib") == 1024
    assert parse_bytes(2e9) == 2e9 and parse_bytes(None) is None and parse_bytes("4096") == 4096.0
    with pytest.raises(ValueError):
        parse_bytes("lots")
    assert format_bytes(1.5 * 2**30) == "1.5 GiB" and format_bytes(512) == "512.0 B"
    assert format_bytes(3 * 2**50) == "3072.0 TiB" and format_bytes(None) == "unbounded memory"


def test_collectives_without_a_process_group_are_this_process_alone() -> None:
    assert not distributed.is_initialized()
    assert distributed.rank() == 0 and distributed.world_size() == 1
    value = {"step": 3}
    assert distributed.broadcast_object(value) is value
    assert distributed.all_gather_object(value) == [value]
    assert distributed.gather_object_to_first(value) == [value]
    assert distributed.exchange_bytes([], []) == []


def test_only_lightnings_leafspec_warning_is_hidden_and_only_from_its_module() -> None:
    hide_inapplicable_warnings()
    message = "`isinstance(treespec, LeafSpec)` is deprecated, use something else"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        hide_inapplicable_warnings()  # (idempotent: installed again over the test's own filter)
        warnings.warn_explicit(message, FutureWarning, "_pytree.py", 1, module="lightning.pytorch.utilities._pytree")
        warnings.warn_explicit(message, FutureWarning, "mine.py", 1, module="my_project.trees")
        warnings.warn_explicit(
            "something else", FutureWarning, "_pytree.py", 2, module="lightning.pytorch.utilities._pytree"
        )
    assert [(str(w.message), w.filename) for w in seen] == [(message, "mine.py"), ("something else", "_pytree.py")]
