"""U64Map, the block index's compiled table, behaves as the insertion-ordered dict of ints it replaces."""

from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.index._u64map import U64Map

KEYS = st.one_of(st.integers(0, 40), st.integers(0, 2**64 - 1))
VALUES = st.one_of(st.integers(0, 300), st.integers(0, 2**80), st.integers(0, 2**200))
OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("set"), KEYS, VALUES),
        st.tuples(st.just("pop"), KEYS, st.none()),
        st.tuples(st.just("move"), KEYS, VALUES),  # pop and set again: the newest entry
        st.tuples(st.just("clear"), st.none(), st.none()),
    ),
    max_size=300,
)


@settings(max_examples=300, deadline=None)
@given(OPERATIONS)
def test_it_keeps_a_dicts_contents_and_order_through_any_operations(operations: list[tuple]) -> None:
    table, model = U64Map(), {}
    for name, key, value in operations:
        if name == "set":
            table[key] = model[key] = value
        elif name == "pop":
            assert table.pop(key, None) == model.pop(key, None)
        elif name == "move":
            table.pop(key, None), model.pop(key, None)
            table[key] = model[key] = value
        elif name == "clear" and len(model) > 200:
            table.clear(), model.clear()
        assert len(table) == len(model)
    assert list(table.items()) == list(model.items())
    assert list(table) == list(model) and list(table.values()) == list(model.values())
    assert table.oldest(5) == list(model)[:5]
    assert all(table.get(key) == value and key in table for key, value in model.items())
    assert table == model


def test_many_entries_removed_from_the_front_leave_the_rest_in_order() -> None:
    table = U64Map()
    table.update((key, key * 3) for key in range(100_000))
    for key in table.oldest(60_000):
        del table[key]
    assert len(table) == 40_000 and table.oldest(2) == [60_000, 60_001]
    table.update((key, 1) for key in range(10))
    assert list(table)[-10:] == list(range(10)) and table[99_999] == 299_997


def test_it_refuses_keys_outside_64_bits_and_negative_values() -> None:
    table = U64Map()
    for key in (-1, 2**64):
        with pytest.raises(OverflowError):
            table[key] = 1
    with pytest.raises(ValueError, match="non-negative"):
        table[1] = -1
    with pytest.raises(KeyError):
        table.pop(5)
    assert len(table) == 0


@pytest.mark.parametrize("change", ["grow", "insert", "remove", "clear"])
def test_an_iteration_raises_when_entries_come_or_go_meanwhile(change: str) -> None:
    table = U64Map()
    table.update((key, key) for key in range(5))
    with pytest.raises(RuntimeError, match="changed during iteration"):
        for _ in table.items():
            if change == "grow":
                table.update((k, k) for k in range(1000, 1100))  # growing the arrays moves the entries
            elif change == "insert":
                table[1000] = 1
            elif change == "remove":
                del table[4]
            else:
                table.clear()
    table = U64Map()
    table.update((key, key) for key in range(5))
    for key, value in table.items():
        table[key] = value + 1  # a value changed in place, as a dict allows
    assert list(table.values()) == [1, 2, 3, 4, 5]


def test_a_cleared_table_takes_entries_again() -> None:
    table = U64Map()
    table.update((key, 2**90 + key) for key in range(50_000))
    table.clear()
    assert len(table) == 0 and list(table) == []
    table[7] = 2**90
    assert list(table.items()) == [(7, 2**90)]


def test_the_holder_probe_gives_each_keys_value_or_zero() -> None:
    table = U64Map()
    table.update([(1, 0b01), (3, 2**100)])
    assert table.masks_of([1, 2, 3]) == [0b01, 0, 2**100]


def test_a_table_that_peaked_shrinks_as_its_entries_churn() -> None:
    """Removing the oldest and adding new ones (the bound's eviction): the arrays compact to what is live."""
    table = U64Map()
    table.update((key, key) for key in range(200_000))
    peak = sys.getsizeof(table)
    for key in range(200_000, 260_000):
        table[key] = key
        if key >= 200_000 + 2_000:
            for old in table.oldest(len(table) - 2_000):
                del table[old]
    assert len(table) == 2_000 and sys.getsizeof(table) < peak / 20
    assert list(table) == list(range(258_000, 260_000))


def test_an_entry_costs_a_fraction_of_a_dicts() -> None:
    """About 35 bytes an entry (25 in the arrays, 4-byte slots) where a dict of ints takes about 100."""
    table, model = U64Map(), {}
    for key in range(1 << 40, (1 << 40) + 100_000):
        table[key] = model[key] = key << 16 | 1
    dict_bytes = sys.getsizeof(model) + sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in model.items())
    assert sys.getsizeof(table) / len(table) < 48 < dict_bytes / len(model)


def test_wide_values_are_shared_and_released() -> None:
    """A mask wider than 80 owners is held by reference: equal ones share one int, and every reference taken
    is given back when its entry is overwritten, removed, compacted away or the table goes."""
    wide = 2**100 + 7
    before = sys.getrefcount(wide)
    table = U64Map()
    table[1] = wide
    table[2] = int(str(wide))  # equal, another object
    assert table[1] is table[2] is wide
    table.update((key, key) for key in range(3, 1000))  # the arrays grow: the references move
    table[1] = 5
    assert table.pop(2) == wide and table.get(1) == 5
    table[3] = wide
    del table
    assert sys.getrefcount(wide) == before  # the interning dict went with the table too
