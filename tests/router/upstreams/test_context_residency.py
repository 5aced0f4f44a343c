"""How long contexts stay on an instance, measured from the tokens it holds and releases (Little's law)."""

from __future__ import annotations

import pytest

from router.upstreams.context_residency import ContextResidency
from router.upstreams.instances import Instance, InstanceSetup
from tests.conftest import ManualClock


def test_unknown_until_a_request_finishes() -> None:
    clock = ManualClock()
    hold = ContextResidency(clock)
    hold.add(1000)
    clock.now = 5.0
    assert hold.seconds is None
    hold.release(1000)
    assert hold.seconds == pytest.approx(5.0)
    assert hold.tokens == 0


def test_steady_overlapping_requests_give_their_duration() -> None:
    """A request of 2,000 tokens every second, each held 3 s: three in flight at any time."""
    clock = ManualClock()
    hold = ContextResidency(clock, memory=20)
    ends: list[float] = []
    for second in range(200):
        clock.now = float(second)
        while ends and ends[0] <= clock.now:
            ends.pop(0)
            hold.release(2000)
        hold.add(2000)
        ends.append(clock.now + 3.0)
    assert hold.tokens == 3 * 2000
    assert hold.seconds == pytest.approx(3.0, rel=0.01)


def test_long_contexts_weigh_by_their_tokens() -> None:
    """One 90K-token context held 10 s beside nine 1K-token ones held 1 s: memory frees at the pace of
    the long one, so the token-weighted hold is near 10 s, not the requests' mean of 1.9 s."""
    clock = ManualClock()
    hold = ContextResidency(clock)
    hold.add(90_000)
    for second in range(9):
        clock.now = float(second)
        hold.add(1000)
        clock.now = second + 1.0
        hold.release(1000)
    clock.now = 10.0
    hold.release(90_000)
    assert hold.seconds == pytest.approx((90_000 * 10 + 9 * 1000) / 99_000, rel=0.05)


def test_refused_requests_leave_the_estimate_alone() -> None:
    """Requests held 4 s each, and as many refused at once: the hold stays 4 s, the tokens in flight 0."""
    clock = ManualClock()
    hold = ContextResidency(clock)
    for second in range(0, 40, 4):
        clock.now = float(second)
        hold.add(1000)
        hold.add(5000)
        hold.withdraw(5000)
        clock.now = second + 4.0
        hold.release(1000)
    assert hold.tokens == 0
    assert hold.seconds == pytest.approx(4.0)


def test_an_instance_keeps_the_hold_its_answered_requests_measure() -> None:
    """What the scorers read as a C field (scorers/_candidate_state.pyx) follows the instance's contexts: set
    as a request is answered, left as it is when one is refused."""
    clock = ManualClock()
    instance = Instance("a", "http://a", frozenset({"m"}), setup=InstanceSetup(clock=clock))
    instance.start(1000, 1000)
    clock.now = 3.0
    assert instance.context_hold_s is None
    instance.end(1000)
    assert instance.context_hold_s == instance.contexts.seconds == pytest.approx(3.0)
    instance.start(5000, 5000)
    clock.now = 10.0
    instance.end(5000, admitted=False)
    assert instance.context_hold_s == pytest.approx(3.0)
