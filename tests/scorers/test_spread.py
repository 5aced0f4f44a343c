"""Spreading what ties: recent placements and free KV memory decide between instances that cost the same,
and never move a session off its prefix."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from router.config import RouterConfig
from scorers.candidate import EngineLoad
from scorers.policy import Policy
from scorers.request import RoutingRequest, TierMatch
from scorers.spread import SpreadParams, SpreadScorer
from tests.conftest import ManualClock
from tests.scorers.candidates import Fake


def test_the_least_placed_and_the_emptiest_score_highest() -> None:
    clock = ManualClock()
    scorer = SpreadScorer(SpreadParams(), clock)
    a, b, c = Fake("a"), Fake("b"), Fake("c")
    request = RoutingRequest("m")
    for chosen in (a, a, b):
        scorer.observe(request, chosen)
    assert scorer.score(request, [a, b, c]) == [0.0, 0.25, 0.5]  # placements 2, 1, 0; memory unknown to all
    full = Fake("full", active_tokens=900, kv_capacity_tokens=1000)
    reported = Fake(
        "reported", load=EngineLoad(0, 0, 0.5)
    )  # the engine's own usage where capacity is unknown
    empty = Fake("empty", active_tokens=0, kv_capacity_tokens=1000)
    assert scorer.score(request, [full, reported, empty]) == pytest.approx([0.5, 0.5 + 0.5 * 4 / 9, 1.0])


def test_placements_count_half_after_a_half_life() -> None:
    clock = ManualClock()
    scorer = SpreadScorer(SpreadParams(half_life_s=10), clock)
    for _ in range(4):
        scorer.observe(RoutingRequest("m"), Fake("a"))
    clock.now = 10
    assert scorer.placements("a") == pytest.approx(2.0)
    clock.now = 30
    assert scorer.placements("a") == pytest.approx(0.5)


def _default_policy(clock: ManualClock, seed: int) -> Policy:
    config = RouterConfig.model_validate(
        {"models": [{"name": "m"}], "instances": [{"name": "i0", "url": "http://127.0.0.1:1"}]}
    )
    return Policy("kvroute", config.policies["kvroute"], clock, random.Random(seed))


def test_new_sessions_on_equal_instances_spread_evenly() -> None:
    """Idle, equal instances: the default policy's other scorers tie, and a random choice would send one of
    eight instances three or more of 16 new sessions about half the time; spreading sends each two."""
    clock = ManualClock()
    for seed in range(20):
        policy = _default_policy(clock, seed)
        candidates = [Fake(f"i{n}") for n in range(8)]
        placed = Counter(
            candidates[
                policy.choose(RoutingRequest("m", session_key=f"s{k}", prompt_tokens=200), candidates)
            ].name
            for k in range(16)
        )
        assert sorted(placed.values()) == [2] * 8, seed


def test_a_session_stays_with_its_prefix_on_the_most_placed_instance() -> None:
    clock = ManualClock()
    policy = _default_policy(clock, 0)
    candidates = [Fake(f"i{n}") for n in range(4)]
    for k in range(6):  # i0 took the last six new sessions' first turns (a run of ties)
        policy.choose(RoutingRequest("m", session_key=f"s{k}", prompt_tokens=200), candidates[:1])
    turn = RoutingRequest(
        "m",
        session_key="s0",
        prompt_tokens=4000,
        prompt_blocks=125,
        block_size=32,
        matches={"i0": TierMatch(gpu=120)},
    )
    assert policy.choose(turn, candidates) == 0
