"""Refusal pacing as a function of the loop clock."""

from __future__ import annotations

import pytest

from vega.pressure.pacing import RefusalPacer


def test_refusals_within_the_rate_are_answered_at_once() -> None:
    pacer = RefusalPacer(rate=10, max_hold_s=1.0)
    assert [pacer.hold("queue_full", now=t * 0.11) for t in range(20)] == [0.0] * 20


def test_a_burst_of_refusals_is_spread_at_the_rate() -> None:
    pacer = RefusalPacer(rate=10, max_hold_s=1.0)
    holds = [pacer.hold("shed", now=5.0) for _ in range(5)]
    assert holds == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])


def test_past_the_cap_each_waits_the_cap_and_the_schedule_stays() -> None:
    pacer = RefusalPacer(rate=10, max_hold_s=0.25)
    holds = [pacer.hold("rate_limited", now=0.0) for _ in range(6)]
    assert holds == pytest.approx([0.0, 0.1, 0.2, 0.25, 0.25, 0.25])
    assert pacer.hold("rate_limited", now=0.3) == pytest.approx(0.0)  # its turn has come


@pytest.mark.parametrize("code", ["draining", "not_ready", "invalid_input", "model_error"])
def test_only_429_refusals_are_paced(code: str) -> None:
    pacer = RefusalPacer(rate=1, max_hold_s=10.0)
    assert [pacer.hold(code, now=0.0) for _ in range(3)] == [0.0, 0.0, 0.0]


def test_rate_zero_turns_pacing_off() -> None:
    pacer = RefusalPacer(rate=0, max_hold_s=10.0)
    assert [pacer.hold("queue_full", now=0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
