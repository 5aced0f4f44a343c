"""U64Map, the block index's compiled table, behaves as the insertion-ordered dict of ints it replaces."""

from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.index._u64map import COUNT_BITS, MOVE_STEP, U64Map, enter_new, u64_key, u64_keys

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


@pytest.mark.parametrize("move_step", [1, MOVE_STEP])  # 1: most operations come while the table moves
@settings(max_examples=300, deadline=None)
@given(operations=OPERATIONS)
def test_it_keeps_a_dicts_contents_and_order_through_any_operations(
    move_step: int, operations: list[tuple]
) -> None:
    table, model = U64Map(move_step), {}
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


def test_a_full_table_moves_to_larger_arrays_a_step_per_insert() -> None:
    """Growing holds no insert for long: each moves at most a step of the entries, and lookups, removals and
    the order see the table whole meanwhile (one move of 10M entries at once held the event loop a second)."""
    table, model = U64Map(move_step=8), {}  # 2 or more: the move ends before the new half's room fills
    key = 0
    for starting in (False, True):  # past a hundred entries and the small tables' moves, to the next move
        while key < 100 or bool(table.moving) != starting:
            table[key] = model[key] = key
            key += 1
    moving = table.moving
    assert moving == len(table) - 1 - 8  # all it held but the first step; then the new key came
    del table[0], model[0]  # moved already
    del table[key - 2], model[key - 2]  # still to move
    moving -= 1
    while table.moving:
        table[key] = model[key] = key * 5
        assert moving - 8 <= table.moving < moving
        moving = table.moving
        assert list(table.items()) == list(model.items()) and table.oldest(2) == list(model)[:2]
        assert all(table[k] == v for k, v in model.items()) and table.get(0) is None
        key += 1
    assert list(table.items()) == list(model.items())


def test_a_move_step_is_at_least_one_entry() -> None:
    with pytest.raises(ValueError, match="at least one"):
        U64Map(move_step=0)


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


def test_the_probe_ors_in_the_speculative_entries() -> None:
    table = U64Map()
    table.update([(1, 0b01), (3, 2**100)])
    pending = {1: 0b10, 2: 0b100, 4: 2**90}  # speculated where held, where not, and not asked for
    assert table.masks_of([1, 2, 3, 5], pending) == [0b11, 0b100, 2**100, 0]
    assert table.masks_of([1, 2, 3], {}) == table.masks_of([1, 2, 3], None) == [0b01, 0, 2**100]
    with pytest.raises(OverflowError):
        table.masks_of([1, -1], pending)


class _LongerThanItIs(list[int]):
    """A chain whose length claims one key more than it gives."""

    def __len__(self) -> int:
        return super().__len__() + 1


def test_a_long_probe_gives_what_a_dict_does_as_the_table_grows() -> None:
    """Probes are pipelined, each key's home loaded ahead: over thousands of keys, in a table that moves to
    larger arrays as it fills, each value is still the one held."""
    table, held = U64Map(), {}
    for key in range(1, 20_000, 3):
        table[key] = held[key] = key * 7
        if key % 2_000 == 1:
            chain = list(range(0, key + 40))
            assert table.masks_of(chain) == [held.get(k, 0) for k in chain]


def test_a_chain_that_lies_about_its_length_is_refused() -> None:
    table = U64Map()
    table.update([(1, 1), (2, 2)])
    with pytest.raises(ValueError, match="fewer keys than its length"):
        table.masks_of(_LongerThanItIs([1, 2]))


def test_a_table_that_peaked_shrinks_as_its_entries_churn() -> None:
    """Removing the oldest and adding new ones (the bound's eviction): the arrays compact to what is live once they fill."""
    table = U64Map()
    table.update((key, key) for key in range(200_000))
    peak = sys.getsizeof(table)
    for key in range(200_000, 400_000):
        table[key] = key
        if key >= 200_000 + 2_000:
            for old in table.oldest(len(table) - 2_000):
                del table[old]
    assert len(table) == 2_000 and sys.getsizeof(table) < peak / 20
    assert list(table) == list(range(398_000, 400_000))


def test_an_entry_costs_a_fraction_of_a_dicts() -> None:
    """About 35 bytes an entry (25 in the arrays, 4-byte slots) where a dict of ints takes about 100."""
    table, model = U64Map(), {}
    for key in range(1 << 40, (1 << 40) + 100_000):
        table[key] = model[key] = key << 16 | 1
    dict_bytes = sys.getsizeof(model) + sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in model.items())
    assert sys.getsizeof(table) / len(table) < 48 < dict_bytes / len(model)


@pytest.mark.parametrize("move_step", [1, MOVE_STEP])
def test_wide_values_are_shared_and_released(move_step: int) -> None:
    """A mask wider than 80 owners is held by reference: equal ones share one int, and every reference taken
    is given back when its entry is overwritten, removed, compacted away or the table goes."""
    wide = 2**100 + 7
    before = sys.getrefcount(wide)
    table = U64Map(move_step)
    table[1] = wide
    table[2] = int(str(wide))  # equal, another object
    assert table[1] is table[2] is wide
    table.update((key, key) for key in range(3, 1000))  # the arrays grow: the references move
    table[1] = 5
    assert table.pop(2) == wide and table.get(1) == 5
    table[3] = wide
    assert table.moving or move_step == MOVE_STEP  # a step at a time: released in the middle of a move
    other = int(str(wide))
    table[4] = table[5] = other  # the same object twice (a store's blocks): shared as the first one was
    assert table[4] is table[5] is wide
    del table, other
    assert sys.getrefcount(wide) == before  # the interning dict went with the table too


@given(st.one_of(st.integers(-(2**100), 2**100), st.binary(max_size=40)))
def test_a_block_hash_keys_by_its_low_64_bits(block_hash: int | bytes) -> None:
    expected = (
        int.from_bytes(block_hash[-8:], "big") if isinstance(block_hash, bytes) else block_hash & (2**64 - 1)
    )
    assert u64_key(block_hash) == expected
    assert u64_keys([block_hash, block_hash]) == [expected, expected]


@pytest.mark.parametrize("block_hash", [1.5, "1", None])
def test_a_block_hash_of_another_type_is_refused(block_hash: object) -> None:
    with pytest.raises(TypeError):
        u64_key(block_hash)  # type: ignore[arg-type]


BULK = st.lists(st.integers(0, 30), max_size=12)


@settings(max_examples=300, deadline=None)
@given(BULK, BULK, st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30)), max_size=8), VALUES)
def test_new_blocks_enter_both_tables_tail_first_or_none_of_them_do(
    held: list[int], used: list[int], store: list[tuple[int, int]], bit: int
) -> None:
    holders, blocks = U64Map(), U64Map()
    holders.update((key, 1) for key in held)
    blocks.update((key, 1) for key in used)
    before = (list(holders.items()), list(blocks.items()))
    own, keys = [h * 2**59 + h for h, _ in store], [k for _, k in store]  # own's top 16 bits too
    entered = enter_new(holders, blocks, own, keys, bit)
    repeated = len(set(own)) < len(own) or len(set(keys)) < len(keys)
    assert entered == (not set(own) & set(held) and not set(keys) & set(used) and not repeated)
    if not entered:
        assert (list(holders.items()), list(blocks.items())) == before
        return
    expected_holders, expected_blocks = dict.fromkeys(held, 1), dict.fromkeys(used, 1)
    for own_hash, key in zip(reversed(own), reversed(keys), strict=True):
        expected_holders[own_hash] = bit
        expected_blocks[key] = (own_hash << COUNT_BITS) + 1
    assert list(holders.items()) == list(expected_holders.items())
    assert list(blocks.items()) == list(expected_blocks.items())


def test_new_blocks_with_mismatched_keys_or_a_negative_owner_are_refused() -> None:
    with pytest.raises(ValueError):
        enter_new(U64Map(), U64Map(), [1, 2], [1], 1)
    with pytest.raises(ValueError):
        enter_new(U64Map(), U64Map(), [1], [1], -1)


@pytest.mark.parametrize("count", [2, 64, 65, 500])  # checked by an insertion sort up to 64, by qsort past it
def test_a_store_naming_a_block_twice_enters_nothing(count: int) -> None:
    own, keys = list(range(1, count + 1)), list(range(1_000, 1_000 + count))
    for repeated_own, repeated_keys in ((own[:-1] + own[:1], keys), (own, [*keys[:-1], keys[count // 3]])):
        holders, blocks = U64Map(), U64Map()
        assert not enter_new(holders, blocks, repeated_own, repeated_keys, 1)
        assert len(holders) == len(blocks) == 0
    holders, blocks = U64Map(), U64Map()
    assert enter_new(holders, blocks, own, keys, 1)
    assert len(holders) == len(blocks) == count


def test_a_store_of_a_hash_past_64_bits_is_refused() -> None:
    with pytest.raises(OverflowError):
        enter_new(U64Map(), U64Map(), [1, 2**64], [1, 2], 1)


def test_a_move_into_mapped_slots_waits_for_their_pages_and_loses_nothing_inserted_meanwhile() -> None:
    """Slots of a megabyte or more are given their pages some at a time before a move writes them all over
    (one fault each, thousands in one store, when it did not wait); a small table's move starts at once."""
    table = U64Map()
    waits: list[tuple[int, int]] = []  # each move's entries to move at its start, and the inserts it waited
    before = 0
    for key in range(400_000):
        table[key * 7919] = key
        moving = table.moving
        if moving > before:
            waits.append((moving, 0))
        elif moving and moving == before:
            waits[-1] = (moving, waits[-1][1] + 1)
        before = moving
    small = [waited for entries, waited in waits if entries < 100_000]
    large = [(entries, waited) for entries, waited in waits if entries > 200_000]
    assert small and not any(small)
    # A table of 1.5x the entries, 5/3 slots an entry, 4 bytes a slot, given 16 KiB an insert.
    assert large and all(waited >= entries * 1.5 * 5 / 3 * 4 // 16384 - 2 for entries, waited in large)
    assert all(table[key * 7919] == key for key in range(400_000))
