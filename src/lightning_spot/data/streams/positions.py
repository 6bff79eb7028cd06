"""Where a stream loader was before each of the last few global batches of its pass.

    log = PositionLog()
    log.restart(done, position)     # a pass starts (or resumes) after ``done`` global batches
    log.record(position)            # one more global batch was read; ``position``: where the next one starts
    log.positions[done]             # what a checkpoint after ``done`` trained global batches holds
    fields = log.mirror()           # the newest two, sent with each batch to the stages that do not read
    log.take(fields, fresh)         # on such a stage (``fresh``: the first batch of a pass)

Lightning reads ahead of what it has trained (one batch, or none for loaders with ``__len__``): the positions
before the last :data:`KEPT` batches are kept, older ones dropped.
"""

from __future__ import annotations

from typing import Any

#: positions kept for global batches read but not yet trained
KEPT = 4


class PositionLog:
    """Positions by the number of global batches of the pass read before them."""

    def __init__(self) -> None:
        self.positions: dict[int, Any] = {}
        #: global batches of this pass read so far (the index of the next one)
        self.next = 0

    def restart(self, done: int, position: Any) -> None:
        self.next, self.positions = done, {done: position}

    def record(self, position: Any) -> None:
        self.next += 1
        self.positions[self.next] = position
        self._prune()

    def mirror(self) -> dict[str, Any]:
        return {"next": self.next, "positions": {k: v for k, v in self.positions.items() if k >= self.next - 1}}

    def take(self, fields: dict[str, Any], fresh: bool) -> None:
        if fresh:
            self.positions = {}
        self.positions.update(fields["positions"])
        self.next = fields["next"]
        self._prune()

    def _prune(self) -> None:
        for old in [i for i in self.positions if i < self.next - KEPT]:
            del self.positions[old]
