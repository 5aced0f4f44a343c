"""Every scorer: one score in [0, 1] per candidate, and the ranking it promises."""

from __future__ import annotations

import pytest

from scorers.inflight_load import InflightLoadParams, InflightLoadScorer
from scorers.registry import SCORERS
from scorers.request import RoutingRequest
from scorers.round_robin import RoundRobinParams, RoundRobinScorer
from tests.scorers.candidates import Fake

REQUEST = RoutingRequest(model="m")


def fleet(*loads: int) -> list[Fake]:
    return [Fake(f"i{n}", load) for n, load in enumerate(loads)]


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        ((0, 0, 0), [1.0, 1.0, 1.0]),
        ((5, 5), [1.0, 1.0]),
        ((0, 4, 8), [1.0, 0.5, 0.0]),
        ((3, 1), [0.0, 1.0]),
        ((7,), [1.0]),
        ((), []),
    ],
)
def test_inflight_load_normalizes_between_least_and_most_loaded(
    loads: tuple[int, ...], expected: list[float]
) -> None:
    assert InflightLoadScorer(InflightLoadParams()).score(REQUEST, fleet(*loads)) == expected


def test_inflight_load_counting_context_tokens_prefers_less_context_over_fewer_requests() -> None:
    """Two long agent turns in flight against five short chats: by requests the long ones' instance is the
    less loaded; by the context every decode step there reads, it is the more."""
    long_turns, short_chats = (
        Fake("long", in_flight=2, active_tokens=160_000),
        Fake("short", in_flight=5, active_tokens=5_000),
    )
    tokens = InflightLoadScorer(InflightLoadParams(count="context_tokens"))
    assert tokens.score(REQUEST, [long_turns, short_chats]) == [0.0, 1.0]
    assert InflightLoadScorer(InflightLoadParams()).score(REQUEST, [long_turns, short_chats]) == [1.0, 0.0]


def test_round_robin_gives_each_candidate_its_turn_as_picks_are_made() -> None:
    scorer = RoundRobinScorer(RoundRobinParams())
    candidates = fleet(0, 0, 0)
    winners = []
    for _ in range(7):
        winner = scorer.score(REQUEST, candidates).index(1.0)
        assert scorer.score(REQUEST, candidates).index(1.0) == winner  # a prediction takes no turn
        scorer.observe(REQUEST, candidates[winner])
        winners.append(winner)
    assert winners == [0, 1, 2, 0, 1, 2, 0]
    assert scorer.score(REQUEST, []) == []


@pytest.mark.parametrize("name", sorted(SCORERS))
def test_registered_scorers_stay_in_range(name: str) -> None:
    scorer = SCORERS[name].build({})
    for loads in [(0,), (0, 1, 2, 100), (9, 9), (3, 0, 3)]:
        scores = scorer.score(REQUEST, fleet(*loads))
        assert len(scores) == len(loads)
        assert all(0.0 <= s <= 1.0 for s in scores)
