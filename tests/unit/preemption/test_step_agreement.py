"""The process's one per-step agreement: every contributor's values in one posting, each handed back its own."""

from __future__ import annotations

from typing import Optional

import torch

from lightning_spot.preemption.coordinate import AgreementCadence, PostedMax
from lightning_spot.preemption.step_agreement import StepAgreement

CPU = torch.device("cpu")


class CountedCadence(AgreementCadence):
    """Posts at every boundary and counts the postings (one rank: no process group, the values come back as posted)."""

    def __init__(self) -> None:
        super().__init__()
        self.postings: list[list[float]] = []

    def due(self) -> bool:
        return True

    def post(self, values: list[float], device: torch.device) -> PostedMax:  # type: ignore[override]
        self.postings.append(list(values))
        return super().post(values, device)


def test_every_contributor_rides_on_one_posting_and_gets_its_own_values_back() -> None:
    cadence = CountedCadence()
    agreement = StepAgreement(cadence)
    got: dict[str, list[float]] = {}
    agreement.join("sigterm", lambda: [1.0], lambda v: got.__setitem__("sigterm", v))
    agreement.join("checkpoint", lambda: [0.0, 2.5, 7.0], lambda v: got.__setitem__("checkpoint", v))
    agreement.post(CPU)
    agreement.post(CPU)  # in flight: the second batch start of an accumulation window posts nothing
    assert len(cadence.postings) == 1 and cadence.postings[0][:4] == [1.0, 0.0, 2.5, 7.0]
    assert got == {}  # nothing is read before it is settled
    agreement.settle()
    assert got == {"sigterm": [1.0], "checkpoint": [0.0, 2.5, 7.0]}
    got.clear()
    agreement.settle()  # settled once: the optimizer step and the checkpoint's step end both call it
    assert got == {}
    agreement.post(CPU)
    assert len(cadence.postings) == 2


def test_a_contributor_with_nothing_to_agree_on_is_left_out_of_that_posting() -> None:
    cadence = CountedCadence()
    agreement = StepAgreement(cadence)
    got: dict[str, list[float]] = {}
    checkpoint: list[Optional[list[float]]] = [None]
    agreement.join("checkpoint", lambda: checkpoint[0], lambda v: got.__setitem__("checkpoint", v))
    agreement.post(CPU)
    assert cadence.postings == []  # nobody has anything to agree on: no collective at all
    agreement.join("sigterm", lambda: [0.0], lambda v: got.__setitem__("sigterm", v))
    agreement.post(CPU)
    agreement.settle()
    assert got == {"sigterm": [0.0]}
    checkpoint[0] = [3.0, 4.0]
    agreement.post(CPU)
    agreement.leave("sigterm")  # gone before the settle: the others still get theirs
    agreement.settle()
    assert got == {"sigterm": [0.0], "checkpoint": [3.0, 4.0]}
    assert agreement.contributors == ["checkpoint"]


def test_a_new_fit_drops_what_was_in_flight_and_starts_the_cadence_again() -> None:
    agreement = StepAgreement()
    got: list[list[float]] = []
    agreement.join("sigterm", lambda: [1.0], got.append)
    agreement.post(CPU)
    agreement.cadence.every = 8
    agreement.reset()
    agreement.settle()
    assert got == [] and agreement.cadence.every == 1
    agreement.post(CPU)  # the first boundary of a fit always posts
    agreement.settle()
    assert got == [[1.0]]
