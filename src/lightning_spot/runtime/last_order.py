"""What comes next, guessed from the order the last run of the same kind went through (for prefetching).

order = LastOrder()
order.begin("train")      # a run starts
order.next_after(item)    # ``item`` is used now: what followed it last time, while this run matches that one
order.end()               # this run's order is kept for the next run of its kind
"""

from __future__ import annotations

from collections.abc import Hashable


class LastOrder:
    """The items each kind of run used, in order, the last time it ran."""

    def __init__(self) -> None:
        self._last: dict[Hashable, list[Hashable]] = {}
        self._kind: Hashable = None
        self._seen: list[Hashable] = []

    def begin(self, kind: Hashable) -> None:
        self._kind, self._seen = kind, []

    def next_after(self, item: Hashable) -> Hashable | None:
        """Record ``item`` as used; return the item that came next last time (``None``: unknown, or this run
        has taken another path)."""
        self._seen.append(item)
        last, position = self._last.get(self._kind), len(self._seen)
        if last is None or position >= len(last) or last[:position] != self._seen:
            return None
        return last[position]

    def end(self) -> None:
        if self._seen:
            self._last[self._kind] = self._seen
        self._seen = []
