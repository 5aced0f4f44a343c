"""Where each owner's contiguous match ends, found a run of equal masks at a time."""

from __future__ import annotations

import itertools
import operator

from hypothesis import given, settings
from hypothesis import strategies as st

from router.index._u64map import and_runs, match_lengths, matches_on_gpu
from scorers.request import TierMatch


def _by_owner(alive: list[int]) -> dict[int, int]:
    """The definition: for each bit of the first mask, by position, the first block without it."""
    ends = {}
    for position in range(alive[0].bit_length() if alive else 0):
        bit = 1 << position
        if alive[0] & bit:
            ends[position] = next((i for i, mask in enumerate(alive) if not mask & bit), len(alive))
    return ends


def _runs(alive: list[int]) -> list[tuple[int, int]]:
    """The definition: (end, value) of each run of equal nonzero values."""
    runs = []
    for index, mask in enumerate(alive):
        if not mask:
            break
        if runs and runs[-1][1] == mask:
            runs[-1] = (index + 1, mask)
        else:
            runs.append((index + 1, mask))
    return runs


@settings(max_examples=500, deadline=None)
@given(st.lists(st.integers(0, 2**90), max_size=40), st.lists(st.integers(0, 39), max_size=20))
def test_each_owner_matches_up_to_the_first_block_it_lacks(held: list[int], repeated: list[int]) -> None:
    for index in repeated:  # the same object again, as the tables' interned masks come
        if 0 < index < len(held):
            held[index] = held[index - 1]
    alive = list(itertools.accumulate(held, operator.and_))
    assert and_runs(held) == _runs(alive)
    found = match_lengths(and_runs(held))
    assert found == _by_owner(alive)
    assert list(found) == sorted(found)  # owners credited in the order of their bits


def test_owners_leaving_together_end_together() -> None:
    fleet = (1 << 1000) - 1
    held = [fleet] * 128 + [0b1010] * 300 + [0b10] * 100 + [0]
    assert and_runs(held) == [(128, fleet), (428, 0b1010), (528, 0b10)]
    assert match_lengths(and_runs(held)) == {b: 128 for b in range(1000) if b not in (1, 3)} | {
        1: 528,
        3: 428,
    }


def test_an_instances_longest_owner_is_its_match_on_gpu() -> None:
    owner_at = {0: ("a", 0), 1: ("a", 1), 2: ("b", 0), 5: ("c", 0)}
    matches = matches_on_gpu({0: 40, 1: 90, 2: 40, 5: 7}, owner_at, TierMatch)
    assert matches == {"a": TierMatch(gpu=90), "b": TierMatch(gpu=40), "c": TierMatch(gpu=7)}
    assert list(matches) == ["a", "b", "c"]  # in the order of their first owners
    assert matches_on_gpu({1: 90, 0: 40}, owner_at, TierMatch) == {
        "a": TierMatch(gpu=90)
    }  # a later, shorter one loses
    shared = matches_on_gpu({0: 40, 2: 40}, owner_at, TierMatch)
    assert shared["a"] is shared["b"]  # one object per length: a large fleet's owners share a few
