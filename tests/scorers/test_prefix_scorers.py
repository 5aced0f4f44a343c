"""Precise prefix and prefill cost: prefix credit by tier, and prefix weighed against queued work."""

from __future__ import annotations

import pytest

from scorers.precise_prefix import PrecisePrefixParams, PrecisePrefixScorer
from scorers.request import RoutingRequest, TierMatch
from scorers.token_cost import TokenCostParams, TokenCostScorer
from tests.scorers.candidates import Fake


def request(prompt_blocks: int, **matches: TierMatch) -> RoutingRequest:
    return RoutingRequest("m", None, prompt_blocks * 16 + 5, prompt_blocks, 16, matches)


@pytest.mark.parametrize(
    ("matches", "expected"),
    [
        ({}, [0.0, 0.0]),
        ({"a": TierMatch(gpu=10)}, [1.0, 0.0]),
        ({"a": TierMatch(gpu=5), "b": TierMatch(gpu=2, cpu=5)}, [0.5, 0.6]),
        ({"b": TierMatch(pool=10)}, [0.0, 0.6]),
    ],
)
def test_precise_prefix_is_the_credited_share_of_the_prompt(
    matches: dict[str, TierMatch], expected: list[float]
) -> None:
    scores = PrecisePrefixScorer(PrecisePrefixParams()).score(request(10, **matches), [Fake("a"), Fake("b")])
    assert scores == pytest.approx(expected)


def test_precise_prefix_of_an_empty_prompt_is_zero() -> None:
    assert PrecisePrefixScorer(PrecisePrefixParams()).score(request(0), [Fake("a")]) == [0.0]


def test_token_cost_counts_queued_prefill_plus_uncached_tokens() -> None:
    scorer = TokenCostScorer(TokenCostParams())
    req = request(10, a=TierMatch(gpu=8), b=TierMatch(cpu=10))
    candidates = [Fake("a", pending_prefill_tokens=100), Fake("b"), Fake("c", pending_prefill_tokens=50)]
    assert scorer.costs(req, candidates) == pytest.approx([100 + 165 - 128, 165 - 128, 50 + 165])


def test_a_shared_prefix_on_a_busy_instance_loses_to_an_idle_one() -> None:
    """The hot-spot case: instance a holds the system prompt (8 of 10 blocks) but already prefills 3 sessions."""
    scorer = TokenCostScorer(TokenCostParams())
    req = request(10, a=TierMatch(gpu=8))
    busy = Fake("a", pending_prefill_tokens=3 * 165)
    assert scorer.score(req, [busy, Fake("b")]) == pytest.approx([166 / (3 * 165 + 37 + 1), 1.0])
    idle = Fake("a")
    assert scorer.score(req, [idle, Fake("b")]) == pytest.approx([1.0, 38 / 166])  # idle: its cache wins


def test_token_cost_ties_score_one() -> None:
    assert TokenCostScorer(TokenCostParams()).score(request(4), [Fake("a"), Fake("b")]) == [1.0, 1.0]
    assert TokenCostScorer(TokenCostParams()).score(request(4), []) == []


def test_decode_pressure_spreads_new_sessions_but_old_ones_stay() -> None:
    scorer = TokenCostScorer(TokenCostParams(decode_weight=0.5))  # the arithmetic below uses 0.5
    # a new session: 2,000 shared system-prompt tokens held by a, 50 of its own
    new = RoutingRequest("m", None, 2050, 64, 32, {"a": TierMatch(gpu=62)})

    def best(candidates: list[Fake], req: RoutingRequest = new) -> str:
        scores = scorer.score(req, candidates)
        return candidates[scores.index(max(scores))].name

    assert best([Fake("a", active_tokens=2050), Fake("b")]) == "a"  # 1025 + 66 < 2050: share the prompt
    five_sessions = Fake("a", active_tokens=5 * 2050)
    assert best([five_sessions, Fake("b")]) == "b"  # 5125 + 66 > 2050: recompute elsewhere
    # an old session with a 20,000-token history cached on the same busy instance stays
    old = RoutingRequest("m", None, 20_050, 626, 32, {"a": TierMatch(gpu=624)})
    assert best([five_sessions, Fake("b")], old) == "a"


def test_token_cost_scores_are_cost_ratios() -> None:
    scorer = TokenCostScorer(TokenCostParams())
    req = RoutingRequest("m", None, 999, 31, 32, {})
    assert scorer.score(req, [Fake("a"), Fake("b", pending_prefill_tokens=1000)]) == pytest.approx([1.0, 0.5])
