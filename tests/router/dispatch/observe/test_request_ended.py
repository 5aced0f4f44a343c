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


@pytest.mark.parametrize("code", sorted(REJECTED))
def test_no_instance_to_take_it_counts_a_rejection(
    counted: tuple[Observers, ABStats, Policy], code: str
) -> None:
    observers, ab, policy = counted
    observers.request_ended(policy, code)
    results = ab.export()["round-robin"]
    assert (results.requests, results.rejected, results.errors) == (1, 1, 0)
    assert (
        observers.metrics.registry.get_sample_value("kvroute_rejected_requests_total", {"reason": code}) == 1
    )


@pytest.mark.parametrize("code", sorted(FAILED))
def test_no_instance_answering_counts_a_failure(
    counted: tuple[Observers, ABStats, Policy], code: str
) -> None:
    observers, ab, policy = counted
    observers.request_ended(policy, code)
    results = ab.export()["round-robin"]
    assert (results.requests, results.rejected, results.errors) == (1, 0, 1)


def test_a_clients_mistake_is_not_the_policys(counted: tuple[Observers, ABStats, Policy]) -> None:
    observers, ab, policy = counted
    observers.request_ended(policy, "invalid_value")
    assert ab.export() == {}
