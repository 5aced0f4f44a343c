"""The compiled handling of score lists and of the KV memory in use (scorers/_scores.pyx) against their
definitions written out in Python: the same floats to the last bit, so compiling them changed no routing."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scorers import _ttft_kernel
from scorers._scores import loads, lower_is_better, named, spread_scores, tied_for_best, weighted_sum
from scorers.candidate import EngineLoad
from scorers.decaying_count import DecayingCount
from scorers.request import RoutingRequest
from tests.scorers.candidates import Fake, Kept

counts = st.integers(0, 2**40)
usages = st.floats(0, 1e9, allow_nan=False)
any_floats = st.floats(allow_nan=True, allow_infinity=True)


def normalized(values: list[float | None]) -> list[float]:
    """The definition: llm-d's (max - v) / (max - min) over the known values; all equal, 1; unknown, 0."""
    known = [v for v in values if v is not None]
    if not known:
        return [0.0] * len(values)
    low, high = min(known), max(known)
    span = high - low
    return [0.0 if v is None else 1.0 if span == 0 else (high - v) / span for v in values]


@settings(max_examples=500, deadline=None)
@given(st.lists(st.none() | counts) | st.lists(st.none() | usages) | st.lists(counts | usages))
def test_normalizing_gives_the_definitions_floats(values: list[float | None]) -> None:
    found = lower_is_better(values)
    assert found == normalized(values)
    assert [type(score) for score in found] == [float] * len(values)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 20).flatmap(
        lambda n: st.lists(
            st.tuples(st.floats(-4, 4), st.lists(any_floats, min_size=n, max_size=n)), max_size=5
        )
    )
)
def test_weighing_adds_as_python_adds(weighted: list[tuple[float, list[float]]]) -> None:
    lists = [scores for _, scores in weighted]
    totals = weighted_sum(lists, [weight for weight, _ in weighted])
    expected = [0.0] * (len(lists[0]) if lists else 0)
    for weight, scores in weighted:  # as a policy added its scorers' lists, one after another
        expected = [total + weight * score for total, score in zip(expected, scores, strict=True)]
    assert [repr(t) for t in totals] == [repr(e) for e in expected]  # NaN compares by its spelling


def test_weighing_refuses_lists_of_other_lengths() -> None:
    with pytest.raises(ValueError, match="1 scores for 2 candidates"):
        weighted_sum([[0.0, 0.0], [1.0]], [1.0, 1.0])
    with pytest.raises(ValueError, match="1 weights for 2 lists"):
        weighted_sum([[0.0], [1.0]], [1.0])


@settings(max_examples=300, deadline=None)
@given(st.lists(any_floats | st.floats(0.999999999999, 1.0), min_size=1, max_size=20))
def test_the_best_are_those_within_a_trillionth_of_the_highest_finite_score(scores: list[float]) -> None:
    ranked = [s if math.isfinite(s) else -math.inf for s in scores]
    best = max(ranked)
    assert tied_for_best(scores) == [i for i, s in enumerate(ranked) if s >= best - 1e-12]


def share_in_use(c: Fake) -> float | None:
    """The definition: contexts in flight over capacity, or the engine's usage when more; None if unknown."""
    held = c.active_tokens / c.kv_capacity_tokens if c.kv_capacity_tokens else None
    if c.load is None:
        return held
    return c.load.kv_usage if held is None else max(held, c.load.kv_usage)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.builds(
            Fake,
            st.sampled_from(["a", "b", "c"]),
            active_tokens=counts,
            kv_capacity_tokens=st.none() | st.just(0) | st.integers(1, 2**40),
            load=st.none() | st.builds(EngineLoad, usages, usages, st.floats(0, 1)),
        ),
        max_size=12,
    ),
    st.floats(0, 100),
)
def test_spreading_scores_the_definitions_placements_and_memory_in_use(
    candidates: list[Fake], now: float
) -> None:
    placed = {"a": DecayingCount(10.0, 0.0), "b": DecayingCount(3.0, 1.0)}
    placed["a"].add(0.0)
    placed["b"].add(2.0)
    placements = normalized([placed[c.name].at(now) if c.name in placed else 0.0 for c in candidates])
    shares = normalized([share_in_use(c) for c in candidates])
    expected = [repr((p + m) / 2) for p, m in zip(placements, shares, strict=True)]
    for kind in (candidates, [Kept(c) for c in candidates]):
        assert [repr(score) for score in spread_scores(kind, placed, now)] == expected


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.builds(Fake, st.sampled_from(["a", "b", "c"]), in_flight=st.integers(0, 64), active_tokens=counts),
        max_size=12,
    ),
    st.none() | st.sampled_from(["a", "b"]),
)
def test_what_the_scorers_read_of_each_candidate_is_its_own_figure(
    candidates: list[Fake], name: str | None
) -> None:
    for kind in (candidates, [Kept(c) for c in candidates]):
        assert loads(kind, False) == [c.in_flight for c in candidates]
        assert loads(kind, True) == [c.active_tokens for c in candidates]
        assert named(kind, name) == [1.0 if c.name == name else 0.0 for c in candidates]


class _LongerThanItIs(list[Fake]):
    """Candidates whose length claims one more than they give."""

    def __len__(self) -> int:
        return super().__len__() + 1


def test_candidates_that_lie_about_their_length_are_refused() -> None:
    candidates = _LongerThanItIs([Fake("a"), Fake("b")])
    with pytest.raises(ValueError, match="fewer than their length"):
        spread_scores(candidates, {}, 0.0)
    with pytest.raises(ValueError, match="fewer than their length"):
        _ttft_kernel.speed_scores(RoutingRequest("m", prompt_tokens=64), candidates, 0.0, 0.0, 0.05, None)
