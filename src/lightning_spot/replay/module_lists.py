"""The lists a LightningModule keeps (Lightning 2's step outputs collected for an epoch's end), and keeping them.

for place, values in module_lists(module): ...   # its public list attributes, and lists in its dict attributes
with lists_kept(module):                         # a run of a step that must leave no entries behind
    ...
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

#: a list's place: the module's attribute, and the key in it when the attribute is a dict of lists (else None)
Place = tuple[str, Any]


def module_lists(module: nn.Module) -> Iterator[tuple[Place, list]]:
    """The module's public attributes that are lists, and the lists held in its public dict attributes."""
    for name, value in vars(module).items():
        if name.startswith("_"):
            continue
        if type(value) is list:
            yield (name, None), value
        elif isinstance(value, dict):
            for key, inner in value.items():
                if type(inner) is list:
                    yield (name, key), inner


def lengths_kept(module: nn.Module) -> Callable[[], None]:
    """A function that makes every list of :func:`module_lists` as long as it is now (dropping later entries; a list
    made since is emptied)."""
    lengths = {id(values): len(values) for _, values in module_lists(module)}

    def undo() -> None:
        for _, values in module_lists(module):
            del values[lengths.get(id(values), 0) :]

    return undo


@contextlib.contextmanager
def lists_kept(module: nn.Module) -> Iterator[None]:
    """Every list of :func:`module_lists` as long as before, afterwards (what a throw-away run appended dropped)."""
    undo = lengths_kept(module)
    try:
        yield
    finally:
        undo()
