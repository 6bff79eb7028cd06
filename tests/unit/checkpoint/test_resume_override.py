"""The one patch of Lightning's resume: choosers of the resume path, in order, and Lightning's method put back."""

from __future__ import annotations

import types
from typing import Any, Optional

from lightning_spot.checkpoint.resume import ResumeOverride


def _trainer() -> tuple[Any, list[Optional[str]]]:
    asked: list[Optional[str]] = []

    def resume_start(checkpoint_path: Optional[str] = None, weights_only: Any = None) -> None:
        asked.append(checkpoint_path)

    connector = types.SimpleNamespace(resume_start=resume_start)
    return types.SimpleNamespace(_checkpoint_connector=connector), asked


def test_choosers_run_in_order_a_heal_first_and_once_and_lightning_gets_the_path() -> None:
    trainer, asked = _trainer()
    original = trainer._checkpoint_connector.resume_start
    override = ResumeOverride.of(trainer)
    assert ResumeOverride.of(trainer) is override, "one override per trainer: Lightning's method patched once"
    override.add("spot_checkpoint", lambda path: None if path else "s3://run")
    trainer._checkpoint_connector.resume_start(None)
    trainer._checkpoint_connector.resume_start("given.ckpt")
    assert asked == ["s3://run", "given.ckpt"], "the run's newest when fit names none; the user's path wins"
    override.add("torchft_heal", lambda _asked: "heal://peer", first=True, once=True)
    trainer._checkpoint_connector.resume_start(None)
    trainer._checkpoint_connector.resume_start(None)
    assert asked[2:] == ["heal://peer", "s3://run"], "a peer's state first, whatever was asked, once"
    override.remove("spot_checkpoint")
    assert trainer._checkpoint_connector.resume_start is original, "the last chooser gone: Lightning's own method"
    assert ResumeOverride.of(trainer) is not override
