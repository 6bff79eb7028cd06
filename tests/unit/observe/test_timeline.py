"""Timeline arithmetic: the theoretical bubble of each schedule, the peak used for MFU."""

from __future__ import annotations

import pytest

from lightning_spot.runtime.schedules import measured_bubble, theoretical_bubble


def test_theoretical_bubble_formulas() -> None:
    assert theoretical_bubble("1F1B", 4, 1, 8) == pytest.approx(3 / 11)
    assert theoretical_bubble("GPipe", 1, 1, 8) == 0.0
    assert theoretical_bubble("Interleaved1F1B", 4, 2, 8) == pytest.approx(3 / 19)
    assert theoretical_bubble("ZBVZeroBubble", 4, 2, 8) == pytest.approx(3 / 19 / 3)
    assert measured_bubble(0.30, 0.24) == pytest.approx(0.2)
    assert measured_bubble(0.0, 0.0) == 0.0


def test_mfu_peak_lookup() -> None:
    from lightning_spot.observe.throughput import peak_flops_of

    assert peak_flops_of("NVIDIA H200") == 989e12
    assert peak_flops_of("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_of("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_of("NVIDIA L4") == 121e12
    assert peak_flops_of("Some Future Accelerator") is None
