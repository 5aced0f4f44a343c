"""The compiled handling of score lists and of the KV memory in use (scorers/_scores.pyx) against their
definitions written out in Python: the same floats to the last bit, so compiling them changed no routing."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from scorers._scores import (
    add_weighted,
    counts_at,
    halfway,
    loads,
    lower_is_better,
    memory_shares,
    named,
    tied_for_best,
)
from scorers.candidate import EngineLoad
from scorers.decaying_count import DecayingCount
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
@given(st.lists(st.tuples(any_floats, any_floats), max_size=20), st.floats(-4, 4))
def test_weighing_adds_as_python_adds(pairs: list[tuple[float, float]], weight: float) -> None:
    totals = [total for total, _ in pairs]
    add_weighted(totals, [score for _, score in pairs], weight)
    expected = [total + weight * score for total, score in pairs]
    assert [repr(t) for t in totals] == [repr(e) for e in expected]  # NaN compares by its spelling


def test_weighing_refuses_a_list_of_another_length() -> None:
    try:
        add_weighted([0.0, 0.0], [1.0], 1.0)
    except ValueError as refused:
        assert "1 scores for 2 candidates" in str(refused)
    else:
        raise AssertionError("scores of another length were added")


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
            st.just("i"),
            active_tokens=counts,
            kv_capacity_tokens=st.none() | st.just(0) | st.integers(1, 2**40),
            load=st.none() | st.builds(EngineLoad, usages, usages, st.floats(0, 1)),
        ),
        max_size=12,
    )
)
def test_the_memory_in_use_is_the_definitions_share(candidates: list[Fake]) -> None:
    expected = [share_in_use(c) for c in candidates]
    assert memory_shares(candidates) == expected == memory_shares([Kept(c) for c in candidates])


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
    placed = DecayingCount(10.0, 0.0)
    placed.add(0.0)
    for kind in (candidates, [Kept(c) for c in candidates]):
        assert loads(kind, False) == [c.in_flight for c in candidates]
        assert loads(kind, True) == [c.active_tokens for c in candidates]
        assert named(kind, name) == [1.0 if c.name == name else 0.0 for c in candidates]
        assert counts_at(kind, {"a": placed}, 5.0) == [
            placed.at(5.0) if c.name == "a" else 0.0 for c in candidates
        ]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(any_floats, any_floats), max_size=20))
def test_halfway_is_the_mean_python_takes(pairs: list[tuple[float, float]]) -> None:
    found = halfway([a for a, _ in pairs], [b for _, b in pairs])
    assert [repr(m) for m in found] == [repr((a + b) / 2) for a, b in pairs]
