"""One non-blocking agreement per step, for every part of the process that must decide alike on every rank.

Lightning's SIGTERM stop (``SigtermAgreement``) and ``SpotCheckpoint`` (a preemption notice, its snapshot and save
intervals measured on each rank's clock) each need the largest of some values over all ranks at a step boundary.
They join this one agreement as contributors, so that a step posts a single small all-reduce (MAX) for all of them,
at its start, without holding any rank there; the strategy settles it after the optimizer step, when every rank has
posted, and each contributor gets its own values back. ``AgreementCadence`` thins the postings out on short steps.

    agreement = StepAgreement()                                  # one per process (the strategy's)
    agreement.join("spot_checkpoint", values, on_agreed)         # alike on every rank
    agreement.post(device)     # at every training batch's start (a no-op while one is in flight)
    agreement.settle()         # after the optimizer step (and wherever a contributor needs the result)
    agreement.leave("spot_checkpoint")
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from lightning_spot.preemption.coordinate import AgreementCadence, PostedMax

#: a contributor's values for this posting (the same length on every rank), or None: nothing to agree on now
Values = Callable[[], Optional[Sequence[float]]]
#: called with the contributor's values, each the largest over all ranks
OnAgreed = Callable[[list[float]], None]


@dataclass(frozen=True)
class _Contributor:
    values: Values
    on_agreed: OnAgreed


class StepAgreement:
    """The per-step agreement of one process: its contributors, its cadence and the posting in flight."""

    def __init__(self, cadence: Optional[AgreementCadence] = None) -> None:
        self.cadence = cadence or AgreementCadence()
        self._contributors: dict[str, _Contributor] = {}
        self._pending: Optional[PostedMax] = None
        #: (contributor, number of values) of the posting in flight, in the order of its values
        self._posted: list[tuple[str, int]] = []

    @property
    def contributors(self) -> list[str]:
        return list(self._contributors)

    def join(self, name: str, values: Values, on_agreed: OnAgreed) -> None:
        """Take part from the next posting on (every rank joins the same contributors, in the same order)."""
        self._contributors[name] = _Contributor(values, on_agreed)

    def leave(self, name: str) -> None:
        self._contributors.pop(name, None)

    def reset(self) -> None:
        """A new fit: nothing in flight, the cadence from its start (every boundary posts at first)."""
        self._pending, self._posted = None, []
        self.cadence = AgreementCadence()

    def post(self, device: torch.device) -> None:
        """At a training batch's start, on every rank: post the contributors' values when the cadence says so and
        none is in flight (so with gradient accumulation, one per optimizer step at most)."""
        if self._pending is not None or not self._contributors or not self.cadence.due():
            return
        values: list[float] = []
        posted: list[tuple[str, int]] = []
        for name, contributor in self._contributors.items():
            mine = contributor.values()
            if mine is not None:
                posted.append((name, len(mine)))
                values.extend(float(v) for v in mine)
        if posted:
            self._pending, self._posted = self.cadence.post(values, device), posted

    def settle(self) -> None:
        """Wait for the posting in flight (every rank has posted it) and hand each contributor its values."""
        pending, posted = self._pending, self._posted
        if pending is None:
            return
        self._pending, self._posted = None, []
        agreed = self.cadence.read(pending)
        start = 0
        for name, count in posted:
            contributor = self._contributors.get(name)
            if contributor is not None:
                contributor.on_agreed(agreed[start : start + count])
            start += count
