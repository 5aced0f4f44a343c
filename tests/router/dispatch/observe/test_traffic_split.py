"""The traffic split: shares within statistical tolerance, sticky sessions, minimal moves on a change, and the
A/B verdict's statistics."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from router.dispatch.observe.ab import ABStats, _bootstrap_medians
from router.traffic_split import TrafficSplit

SESSIONS = [f"session-{i}" for i in range(2000)]


def test_sessions_split_by_weight_within_tolerance() -> None:
    split = TrafficSplit({"round-robin": 90, "kvroute": 10})
    counts = Counter(split.policy_for(s) for s in SESSIONS)
    # Binomial: 200 expected, standard deviation 13.4; four of them is a failure once in 15,000 runs.
    assert abs(counts["kvroute"] - 200) <= 54, counts


def test_a_session_keeps_its_policy_while_the_split_stays() -> None:
    split = TrafficSplit({"a": 1, "b": 1, "c": 2})
    first = {s: split.policy_for(s) for s in SESSIONS}
    for _ in range(3):
        assert all(split.policy_for(s) == policy for s, policy in first.items())


def test_changing_the_split_moves_only_the_sessions_it_must() -> None:
    before = TrafficSplit({"a": 90, "b": 10})
    after = TrafficSplit({"a": 50, "b": 50})
    moved = [s for s in SESSIONS if before.policy_for(s) != after.policy_for(s)]
    assert all(before.policy_for(s) == "a" and after.policy_for(s) == "b" for s in moved)
    assert abs(len(moved) - 800) <= 90  # 40% of the sessions, and no others
    everything_to_b = TrafficSplit({"a": 0, "b": 100})
    assert {everything_to_b.policy_for(s) for s in SESSIONS} == {"b"}


def test_requests_without_a_session_are_drawn_one_by_one() -> None:
    split = TrafficSplit({"a": 1, "b": 3}, rng=random.Random(1))
    counts = Counter(split.policy_for(None) for _ in range(4000))
    assert abs(counts["b"] - 3000) <= 110


@pytest.mark.parametrize(
    "weights",
    [
        {"a": 0},
        {"a": -1, "b": 2},
        {},
        {"a": float("inf"), "b": 1},
        {"a": float("nan")},
        {"a": 1e308, "b": 1e308},
    ],
)
def test_a_split_needs_a_positive_weight_and_no_negative_one(weights: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        TrafficSplit(weights)


def test_the_verdict_names_the_faster_policy_only_when_the_interval_excludes_zero() -> None:
    rng = random.Random(3)
    stats = ABStats()
    for _ in range(400):
        stats.first_byte("base", rng.lognormvariate(-1.6, 0.4))  # median about 200 ms
        stats.first_byte("fast", rng.lognormvariate(-2.3, 0.4))  # median about 100 ms
        stats.first_byte("same", rng.lognormvariate(-1.6, 0.4))
    report = stats.report({"base": 1, "fast": 1, "same": 1})
    fast, same = report["comparisons"]
    assert fast["verdict"].startswith("fast is faster by ")
    low, high = fast["ci95_ms"]
    assert 0 < low <= fast["ttft_p50_diff_ms"] <= high
    assert 80 < fast["ttft_p50_diff_ms"] < 120
    assert same["verdict"].startswith("no significant difference yet")
    assert same["ci95_ms"][0] < 0 < same["ci95_ms"][1]


def test_too_few_samples_get_no_verdict() -> None:
    stats = ABStats()
    for _ in range(10):
        stats.first_byte("a", 0.1)
        stats.first_byte("b", 0.2)
    (comparison,) = stats.report({"a": 1, "b": 1})["comparisons"]
    assert comparison["verdict"].startswith("not enough data yet (10 and 10 TTFTs")


def _clustered(stats: ABStats, policy: str, rng: random.Random, keyed: bool) -> None:
    """12 sessions of 40 turns, each turn near its session's own typical TTFT (which varies 5x between
    sessions): the same distribution for every policy."""
    for session in range(12):
        typical = rng.lognormvariate(-1.6, 0.8)
        for _ in range(40):
            stats.first_byte(
                policy, typical * rng.uniform(0.9, 1.1), f"{policy}-{session}" if keyed else None
            )


def test_the_interval_resamples_sessions_so_a_few_long_ones_do_not_make_a_winner() -> None:
    """Identical policies, a few long sessions each: counted as 480 independent requests, the interval is
    narrow and names a winner; resampled by session, it is wide and does not."""
    comparisons = []
    for keyed in (False, True):
        rng = random.Random(5)
        stats = ABStats()
        _clustered(stats, "base", rng, keyed)
        _clustered(stats, "same", rng, keyed)
        (comparison,) = stats.report({"base": 1, "same": 1})["comparisons"]
        comparisons.append(comparison)
    by_request, by_session = comparisons
    assert by_request["ttft_p50_diff_ms"] == by_session["ttft_p50_diff_ms"]  # the same samples
    assert not by_request["verdict"].startswith("no significant difference")
    assert by_session["verdict"].startswith("no significant difference yet")
    width = [high - low for low, high in (c["ci95_ms"] for c in comparisons)]
    assert width[1] > 3 * width[0]
    assert by_request["sessions"] == [480, 480] and by_session["sessions"] == [12, 12]


def test_a_handful_of_sessions_gets_no_verdict_however_many_requests() -> None:
    stats = ABStats()
    for turn in range(200):
        stats.first_byte("a", 0.1 + turn / 1e4, "one")
        stats.first_byte("b", 0.2 + turn / 1e4, "other")
    (comparison,) = stats.report({"a": 1, "b": 1})["comparisons"]
    assert comparison["sessions"] == [1, 1]
    assert comparison["verdict"] == "not enough sessions yet (1 and 1, 10 each needed)"


def test_each_bootstrap_round_takes_the_median_of_the_sessions_it_drew() -> None:
    """np.median of the samples of the drawn sessions, repeated as often as drawn: odd and even totals."""
    values = np.array([0.5, 0.1, 0.4, 0.3, 0.2, 0.9, 0.7])
    sessions = np.array([0, 0, 1, 2, 2, 2, 3])
    medians = _bootstrap_medians(values, sessions, 4, np.random.default_rng(7))
    draws = np.random.default_rng(7).integers(0, 4, (len(medians), 4))
    for drawn, median in zip(draws[:50], medians[:50], strict=True):
        expected = np.median(np.concatenate([values[sessions == s] for s in drawn]))
        assert median == pytest.approx(expected)
