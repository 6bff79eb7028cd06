"""The shipped spot traces (Bamboo's AWS availability data) read as step functions and replay as join/leave events."""

from __future__ import annotations

import pytest

from benchmarks.spot_traces import fixed_rate, load_trace, shipped


@pytest.mark.parametrize("name", shipped())
def test_events_rebuild_the_available_count(name: str) -> None:
    trace = load_trace(name)
    assert trace.duration > 3600 and max(trace.counts) >= 8
    for cap in (None, 4):
        running = 0
        for _, change in trace.events(cap=cap):
            running += change
            assert 0 <= running <= (cap or max(trace.counts))
        assert running == min(trace.counts[-1], cap or trace.counts[-1])


def test_the_g4dn_trace_of_us_east_1c() -> None:
    trace = load_trace("aws-spot-instances-g4dn-xlarge-us-east-1c-2020-11-20-1930-to-2020-11-21-2200")
    assert trace.at(0) == 0 and trace.at(21529) == 4 and trace.at(21556) == 12  # the same second set twice
    assert trace.at(10**6) == 7


def test_fixed_rate_loses_one_node_per_period() -> None:
    trace = fixed_rate(nodes=4, every_seconds=600, duration_seconds=3600)
    assert [trace.at(t) for t in (0, 599, 600, 1200, 1800, 3600)] == [4, 4, 3, 2, 1, 1]
    assert [c for _, c in trace.events()] == [+1] * 4 + [-1] * 3
