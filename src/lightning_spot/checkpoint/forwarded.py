"""A setting of ``SpotCheckpoint`` held by the parts that act on it, so that it has one value wherever it is read.

    class SpotCheckpoint(L.Callback):
        keep_last = Forwarded("saver.keep_last")
        every_n_train_steps = Forwarded("policy.every_n_train_steps", "cadence.durable_steps")

    ckpt.keep_last = 5   # after construction too, as users change ModelCheckpoint's: the saver keeps 5

Reading gives the first part's value; setting reaches every part named.
"""

from __future__ import annotations

from typing import Any


class Forwarded:
    """A data descriptor over attributes of the owner's parts (``"part.attribute"``, see the module's text)."""

    def __init__(self, *paths: str) -> None:
        self.paths = [tuple(path.split(".", 1)) for path in paths]

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        part, attribute = self.paths[0]
        return getattr(getattr(obj, part), attribute)

    def __set__(self, obj: Any, value: Any) -> None:
        for part, attribute in self.paths:
            setattr(getattr(obj, part), attribute, value)
