"""Scorers of engine load and of sessions: their ranking, their range, and candidates without data."""

from __future__ import annotations

import pytest

from scorers.candidate import EngineLoad
from scorers.kv_usage import KvUsageParams, KvUsageScorer
from scorers.queue_depth import QueueDepthParams, QueueDepthScorer
from scorers.registry import SCORERS
from scorers.request import RoutingRequest
from scorers.session_affinity import SessionAffinityParams, SessionAffinityScorer
from tests.conftest import ManualClock
from tests.scorers.candidates import Fake

REQUEST = RoutingRequest(model="m")


def waiting(*queues: float | None) -> list[Fake]:
    return [Fake(f"i{n}", load=None if q is None else EngineLoad(q, 0.0, 0.0)) for n, q in enumerate(queues)]


def usage(*fractions: float | None) -> list[Fake]:
    return [
        Fake(f"i{n}", load=None if u is None else EngineLoad(0.0, 0.0, u)) for n, u in enumerate(fractions)
    ]


@pytest.mark.parametrize(
    ("queues", "expected"),
    [
        ((0, 4, 8), [1.0, 0.5, 0.0]),
        ((3, 1), [0.0, 1.0]),
        ((2, 2, 2), [1.0, 1.0, 1.0]),
        ((5,), [1.0]),
        ((None, 0, 10), [0.0, 1.0, 0.0]),
        ((None, 3, 3), [0.0, 1.0, 1.0]),  # missing data never wins, not even a tie
        ((None, 7), [0.0, 1.0]),
        ((None, None), [0.0, 0.0]),
        ((), []),
    ],
)
def test_queue_depth_normalizes_between_shortest_and_longest_queue(
    queues: tuple[float | None, ...], expected: list[float]
) -> None:
    assert QueueDepthScorer(QueueDepthParams()).score(REQUEST, waiting(*queues)) == expected


@pytest.mark.parametrize(
    ("fractions", "expected"),
    [
        ((0.0, 0.25, 1.0), [1.0, 0.75, 0.0]),
        ((1.5, -0.5), [0.0, 1.0]),  # out-of-range usage is clamped
        ((None, 0.9), [0.0, pytest.approx(0.1)]),
        ((None,), [0.0]),
        ((), []),
    ],
)
def test_kv_usage_scores_the_free_fraction(
    fractions: tuple[float | None, ...], expected: list[float]
) -> None:
    assert KvUsageScorer(KvUsageParams()).score(REQUEST, usage(*fractions)) == expected


def session(key: str | None) -> RoutingRequest:
    return RoutingRequest(model="m", session_key=key)


def affinity(clock: ManualClock, **params: float) -> SessionAffinityScorer:
    return SessionAffinityScorer(SessionAffinityParams.model_validate(params), clock=clock)


FLEET = [Fake("a"), Fake("b"), Fake("c")]


def test_session_affinity_follows_the_last_choice() -> None:
    scorer = affinity(ManualClock())
    assert scorer.score(session("s1"), FLEET) == [0.0, 0.0, 0.0]  # not seen yet
    scorer.observe(session("s1"), FLEET[1])
    assert scorer.score(session("s1"), FLEET) == [0.0, 1.0, 0.0]
    assert scorer.score(session("s2"), FLEET) == [0.0, 0.0, 0.0]
    scorer.observe(session("s1"), FLEET[2])
    assert scorer.score(session("s1"), FLEET) == [0.0, 0.0, 1.0]
    assert scorer.score(session("s1"), FLEET[:2]) == [0.0, 0.0]  # its instance is not a candidate now


def test_requests_without_a_session_key_have_no_affinity() -> None:
    scorer = affinity(ManualClock())
    scorer.observe(session(None), FLEET[0])
    assert len(scorer) == 0
    assert scorer.score(session(None), FLEET) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("elapsed_s", "expected"),
    [(0.0, [1.0, 0.0, 0.0]), (10.0, [1.0, 0.0, 0.0]), (10.01, [0.0, 0.0, 0.0]), (1e6, [0.0, 0.0, 0.0])],
)
def test_session_affinity_expires_ttl_after_the_last_request(elapsed_s: float, expected: list[float]) -> None:
    clock = ManualClock()
    scorer = affinity(clock, ttl_s=10)
    scorer.observe(session("s"), FLEET[0])
    clock.now += elapsed_s
    assert scorer.score(session("s"), FLEET) == expected


def test_each_request_of_a_session_renews_its_ttl() -> None:
    clock = ManualClock()
    scorer = affinity(clock, ttl_s=10)
    for _ in range(5):
        scorer.observe(session("s"), FLEET[0])
        clock.now += 8
    assert scorer.score(session("s"), FLEET) == [1.0, 0.0, 0.0]
    clock.now += 8
    assert scorer.score(session("s"), FLEET) == [0.0, 0.0, 0.0]
    assert len(scorer) == 0  # expired sessions are dropped when found


def test_the_least_recently_sent_session_is_dropped_first() -> None:
    scorer = affinity(ManualClock(), max_sessions=2)
    scorer.observe(session("old"), FLEET[0])
    scorer.observe(session("mid"), FLEET[1])
    scorer.observe(session("old"), FLEET[0])  # now more recent than mid
    scorer.observe(session("new"), FLEET[2])
    assert len(scorer) == 2
    assert [scorer.score(session(k), FLEET) for k in ("old", "mid", "new")] == [
        [1.0, 0.0, 0.0],
        [0.0, 0.0, 0.0],
        [0.0, 0.0, 1.0],
    ]


@pytest.mark.parametrize(
    ("params", "key"), [({"max_sessions": 0}, "max_sessions"), ({"ttl_s": 0}, "ttl_s"), ({"ttl": 5}, "ttl")]
)
def test_session_affinity_rejects_bad_params(params: dict[str, int], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        SCORERS["session-affinity"].build(params)


LOADS = [None, EngineLoad(0, 0, 0), EngineLoad(3, 2, 0.5), EngineLoad(100, 9, 1.0), EngineLoad(1, 1, 1.7)]


@pytest.mark.parametrize("name", ["queue-depth", "kv-usage", "session-affinity"])
def test_registered_load_scorers_stay_in_range(name: str) -> None:
    scorer = SCORERS[name].build({})
    for count in range(len(LOADS) + 1):
        candidates = [Fake(f"i{n}", load=load) for n, load in enumerate(LOADS[:count])]
        scores = scorer.score(session("s"), candidates)
        assert len(scores) == count
        assert all(0.0 <= s <= 1.0 for s in scores)
        assert all(
            s == 0.0
            for s, c in zip(scores, candidates, strict=True)
            if c.load is None or name == "session-affinity"
        )
