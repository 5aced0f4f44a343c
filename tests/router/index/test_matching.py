"""Where each owner's contiguous match ends, found a run of equal masks at a time."""

from __future__ import annotations

import itertools
import operator

from hypothesis import given, settings
from hypothesis import strategies as st

from router.index.matching import match_lengths


def _by_owner(alive: list[int]) -> dict[int, int]:
    """The definition: for each bit of the first mask, the first block without it."""
    ends = {}
    for position in range(alive[0].bit_length() if alive else 0):
        bit = 1 << position
        if alive[0] & bit:
            ends[bit] = next((i for i, mask in enumerate(alive) if not mask & bit), len(alive))
    return ends


@settings(max_examples=500, deadline=None)
@given(st.lists(st.integers(0, 2**90), max_size=40))
def test_each_owner_matches_up_to_the_first_block_it_lacks(held: list[int]) -> None:
    alive = list(itertools.accumulate(held, operator.and_))
    found = match_lengths(alive)
    assert found == _by_owner(alive)
    assert list(found) == sorted(found)  # owners credited in the order of their bits


def test_owners_leaving_together_end_together() -> None:
    fleet = (1 << 1000) - 1
    alive = [fleet] * 128 + [0b1010] * 300 + [0b10] * 100
    assert match_lengths(alive) == {1 << b: 128 for b in range(1000) if b not in (1, 3)} | {
        0b10: 528,
        0b1000: 428,
    }
