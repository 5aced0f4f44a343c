"""Pickers and the weighted combination of scorers in a policy."""

from __future__ import annotations

import math
import random
from collections import Counter

from scorers.pickers import MaxScoreParams, MaxScorePicker, Picker, SoftmaxParams, SoftmaxPicker
from scorers.policy import Policy, best_first
from scorers.policy_config import PickerSpec, PolicyConfig, ScorerSpec
from scorers.request import RoutingRequest
from tests.conftest import ManualClock
from tests.scorers.candidates import Fake


def test_max_score_picks_the_best() -> None:
    assert MaxScorePicker(MaxScoreParams()).pick([0.1, 0.9, 0.3]) == 1


def test_max_score_breaks_ties_at_random() -> None:
    picker = MaxScorePicker(MaxScoreParams(), random.Random(1))
    picks = Counter(picker.pick([0.5, 1.0, 1.0, 1.0]) for _ in range(3000))
    assert set(picks) == {1, 2, 3}
    assert min(picks.values()) > 800


def test_softmax_prefers_higher_scores_and_sharpens_as_temperature_falls() -> None:
    def share_of_best(temperature: float) -> float:
        picker = SoftmaxPicker(SoftmaxParams(temperature=temperature), random.Random(2))
        return sum(picker.pick([1.0, 0.5, 0.0]) == 0 for _ in range(4000)) / 4000

    warm, cold = share_of_best(1.0), share_of_best(0.05)
    assert 0.4 < warm < 0.6  # e^1 / (e^1 + e^0.5 + 1) = 0.51
    assert cold > 0.99


def test_non_finite_totals_rank_lowest_and_never_crash_a_pick() -> None:
    """A scorer's overflow (nan, inf) must not take routing down: such totals lose to any finite one."""
    nan, inf = math.nan, math.inf
    pickers: list[Picker] = [
        MaxScorePicker(MaxScoreParams(), random.Random(3)),
        SoftmaxPicker(SoftmaxParams(temperature=0.1), random.Random(4)),
    ]
    for picker in pickers:
        assert {picker.pick([nan, 0.2, inf, -inf]) for _ in range(200)} == {1}
        assert {picker.pick([nan, inf, nan]) for _ in range(200)} == {0, 1, 2}  # nothing finite: any


def test_policy_weights_scorers() -> None:
    config = PolicyConfig(
        scorers=[ScorerSpec(type="inflight-load", weight=1.0), ScorerSpec(type="round-robin", weight=3.0)],
        picker=PickerSpec(type="max-score"),
    )
    policy = Policy("mix", config)
    candidates = [Fake("a", 0), Fake("b", 10)]
    # Round robin (weight 3) outweighs load (weight 1): the turn goes a, b, a, b.
    assert [policy.choose(RoutingRequest("m"), candidates) for _ in range(4)] == [0, 1, 0, 1]


def test_session_affinity_in_a_policy_expires_on_the_policys_clock() -> None:
    """The simulation runs policies on simulated time: a session's affinity must end ttl_s after its last
    request on that clock, not on the wall's."""
    clock = ManualClock()
    config = PolicyConfig(
        scorers=[
            ScorerSpec(type="session-affinity", weight=1.0, params={"ttl_s": 60}),
            ScorerSpec(type="inflight-load", weight=0.5),
        ],
        picker=PickerSpec(type="max-score"),
    )
    policy = Policy("sticky", config, clock)
    idle, busy = Fake("idle", 0), Fake("busy", 5)
    session = RoutingRequest("m", session_key="s1")
    assert policy.choose(session, [busy, idle]) == 1
    assert policy.choose(session, [Fake("busy", 0), Fake("idle", 5)]) == 1  # stays while it is fresh
    clock.now = 61
    assert policy.choose(session, [Fake("busy", 0), Fake("idle", 5)]) == 0  # expired: load decides


def test_a_pick_carries_the_totals_it_was_made_by_and_its_fallbacks_follow_them() -> None:
    """A pick hands back the totals it chose by, which Conductor.pick ranks a gateway's fallbacks from
    instead of scoring the candidates again (over 1,000 instances, the decision's cost twice)."""
    config = PolicyConfig(scorers=[ScorerSpec(type="inflight-load")], picker=PickerSpec(type="max-score"))
    policy = Policy("load", config)
    candidates = [Fake("a", 5), Fake("b", 0), Fake("c", 9), Fake("d", 2)]
    pick = policy.pick(RoutingRequest("m"), candidates)
    assert pick.index == 1 and len(pick.totals) == 4
    assert best_first(pick.totals) == [1, 3, 0, 2]  # the least loaded first
    assert policy.pick(RoutingRequest("m"), candidates[:1]).totals == ()  # one candidate: nothing scored


def test_fallbacks_rank_a_broken_total_last() -> None:
    assert best_first([0.2, math.nan, 0.9, 0.5, -math.inf]) == [2, 3, 0, 1, 4]


def test_a_prediction_is_the_choice_the_scores_would_make_and_changes_nothing() -> None:
    """Policy.predict (a program's next turn foreseen, router/programs/warm_ups.py) tells no observer and
    takes no turn: session affinity still follows the last pick, round robin's turn stays."""
    config = PolicyConfig(
        scorers=[ScorerSpec(type="session-affinity", weight=2.0), ScorerSpec(type="round-robin")],
        picker=PickerSpec(type="max-score"),
    )
    policy = Policy("sticky", config)
    candidates = [Fake("a", 0), Fake("b", 0)]
    session = RoutingRequest("m", session_key="s1")
    assert policy.choose(session, candidates) == 0
    other = RoutingRequest("m", session_key="s2")
    assert [policy.predict(other, candidates) for _ in range(3)] == [1, 1, 1]  # round robin's turn: b
    assert policy.predict(session, candidates) == 0  # its affinity to a outweighs the turn
    assert policy.choose(other, candidates) == 1 and policy.choose(other, candidates) == 1  # b by affinity
    assert policy.predict(other, candidates[:1]) == 0
