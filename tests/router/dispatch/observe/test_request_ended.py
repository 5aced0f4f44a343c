"""A request the place stage ends with an error is counted once, by its error's code: turned away, failed, or
neither (router/dispatch/observe/observers.py Observers.request_ended)."""

from __future__ import annotations

import pytest

from router.dispatch.observe.ab import ABStats
from router.dispatch.observe.events import Event
from router.dispatch.observe.observers import FAILED, REJECTED, Observers
from router.metrics import RouterMetrics
from scorers.policy import Policy
from scorers.policy_config import builtin_policies


@pytest.fixture
def counted() -> tuple[Observers, ABStats, Policy]:
    metrics, ab = RouterMetrics(), ABStats()
    observers = Observers(metrics, lambda _: ab, Event())
    return observers, ab, Policy("round-robin", builtin_policies()["round-robin"])


ENDS = [(code, "rejected") for code in sorted(REJECTED)] + [(code, "failed") for code in sorted(FAILED)]


@pytest.mark.parametrize(("code", "ended"), ENDS)
def test_turned_away_or_failed_is_counted_once_against_its_policy(
    counted: tuple[Observers, ABStats, Policy], code: str, ended: str
) -> None:
    observers, ab, policy = counted
    observers.request_ended(policy, code)
    results = ab.export()["round-robin"]
    rejected = ended == "rejected"
    assert (results.requests, results.rejected, results.errors) == (1, int(rejected), int(not rejected))
    refusals = observers.metrics.registry.get_sample_value(
        "kvroute_rejected_requests_total", {"reason": code}
    )
    assert refusals == (1 if rejected else None)  # a failure is not the router's refusal


def test_a_clients_mistake_is_not_the_policys(counted: tuple[Observers, ABStats, Policy]) -> None:
    observers, ab, policy = counted
    observers.request_ended(policy, "invalid_value")
    assert ab.export() == {}
