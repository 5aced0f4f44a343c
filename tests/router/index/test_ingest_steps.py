"""A batch applied in steps (BlockIndex.apply_in_steps) ends as the same batch applied whole, table for table
and in the same order, and a lookup between two steps sees the batch up to some point and nothing after it."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.index.block_index import BlockIndex
from router.index.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from router.index.holdings import Holdings
from router.prompt import block_hashing
from scorers.request import TierMatch
from tests.router.index.test_fuzz_events import (
    BS,
    CHAINS,
    FUZZ,
    OWNERS,
    bad_stores,
    good_stores,
    pool_stores,
    removes,
)
from tests.router.index.test_kv_groups import full, group_removed, mamba, window

# Bytes hashes name positions the same in every event: a store's keys are unique within it, as vLLM's are.
events = st.one_of(good_stores(), bad_stores(), removes(), pool_stores()).map(lambda op: op[1][1])
batches = st.lists(st.one_of(events, st.just(AllBlocksCleared())), min_size=1, max_size=8)


def tables(index: BlockIndex) -> dict[str, Any]:
    """Everything an index holds, each mapping as its items in order (the bound evicts the oldest first)."""
    holdings, pools, groups = index._holdings, index._pools, index._groups
    return {
        "holders": [list(tier.items()) for tier in holdings.holders],
        "owners": {o: ([list(b.items()) for b in s.blocks], s.bit) for o, s in holdings.owners.items()},
        "entries": holdings.entries,
        "stats": dict(vars(index.stats)),
        "pools": {
            name: ([list(b.items()) for b in p.blocks], list(p.hashes.items()), p.bit)
            for name, p in pools._pools.items()
        },
        "groups": {
            bit: {g: (list(group.keys.items()), list(group.held.items())) for g, group in owned.items()}
            for bit, owned in groups._owners.items()
        },
        "anchored": set(groups._anchored),
    }


def applied(history: list[tuple[tuple[str, int], list[KVEvent]]], step: int | None) -> BlockIndex:
    index = BlockIndex(BS, max_entries=40)
    index.set_pool_name("c", "other")
    for owner, batch in history:
        if step is None:
            index.apply(owner, batch)
        else:
            for _ in index.apply_in_steps(owner, batch, step):
                pass
    return index


@FUZZ
@given(
    st.lists(st.tuples(st.sampled_from(OWNERS), batches), min_size=1, max_size=6), st.sampled_from([1, 2, 3])
)
def test_any_batches_applied_in_steps_end_as_applied_whole(
    history: list[tuple[tuple[str, int], list[KVEvent]]], step: int
) -> None:
    assert tables(applied(history, step)) == tables(applied(history, None))


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(OWNERS), batches), min_size=1, max_size=6))
def test_the_compiled_store_fills_the_index_as_the_general_path_does(
    history: list[tuple[tuple[str, int], list[KVEvent]]],
) -> None:
    """Holdings.store_along, the common store in one compiled call, against the path every other store takes
    (held blocks, orphans, mismatched shapes, adapters and extra keys included)."""
    compiled = applied(history, None)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Holdings, "store_along", lambda *_: False)
        general = applied(history, None)
    assert tables(compiled) == tables(general)


HYBRID = [
    [full(0, 8), window(0, 8)],
    [full(0, 8), *mamba(2, 5), group_removed(2)],
    [window(0, 8), full(0, 8), group_removed(0, 1, 2), AllBlocksCleared(), full(0, 3), window(0, 3)],
    [msgspec.structs.replace(full(0, 8), medium="CPU"), full(0, 8), window(0, 6)],
]


@pytest.mark.parametrize("batch", HYBRID)
@pytest.mark.parametrize("step", [1, 3])
def test_a_hybrid_models_batch_applied_in_steps_ends_as_applied_whole(
    batch: list[KVEvent], step: int
) -> None:
    history = [(("a", 0), batch), (("a", 0), [group_removed(5, 6), window(4, 4)])]
    assert tables(applied(history, step)) == tables(applied(history, None))


def units(batch: list[KVEvent]) -> list[KVEvent]:
    """The batch with each removal of many blocks as removals of one (as vLLM sends them): what a lookup
    between two steps may see a prefix of."""
    return [
        piece
        for event in batch
        for piece in (
            [msgspec.structs.replace(event, block_hashes=[h]) for h in event.block_hashes]
            if isinstance(event, BlockRemoved) and event.block_hashes
            else [event]
        )
    ]


@FUZZ
@given(st.lists(st.one_of(good_stores(), removes()).map(lambda op: op[1][1]), min_size=1, max_size=10))
def test_a_lookup_between_steps_sees_the_batch_up_to_some_block(batch: list[KVEvent]) -> None:
    owner, pieces = ("a", 0), units(batch)
    seen = []  # each chain's match after each prefix of the batch, applied whole
    for end in range(len(pieces) + 1):
        index = BlockIndex(BS)
        index.apply(owner, pieces[:end])
        seen.append([index.match(chain) for chain in CHAINS])
    stepped = BlockIndex(BS)
    reached = 0
    for _ in stepped.apply_in_steps(owner, batch, 2):
        matches = [stepped.match(chain) for chain in CHAINS]
        assert matches in seen[reached:]
        reached = seen.index(matches, reached)
    assert [stepped.match(chain) for chain in CHAINS] == seen[-1]


def test_a_store_of_more_blocks_than_a_step_is_reachable_only_once_all_of_it_is_in() -> None:
    tokens = list(range(1000, 1000 + 40 * BS))
    chain = block_hashing.chain(tokens, BS)
    index = BlockIndex(BS)
    index.apply(("a", 0), [BlockStored([1000], None, tokens[:BS], BS, None, "GPU", None)])
    event = BlockStored(list(range(1, 40)), 1000, tokens[BS:], BS, None, "GPU", None)
    matched = [index.match(chain) for _ in index.apply_in_steps(("a", 0), [event], 7)]
    assert len(matched) >= 2 * 6  # hashed, entered: six steps each
    assert set(map(str, matched[:-1])) == {str({"a": TierMatch(gpu=1)})}
    assert matched[-1] == index.match(chain) == {"a": TierMatch(gpu=40)}
