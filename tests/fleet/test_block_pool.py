"""The simulated KV cache keeps vLLM's prefix-caching semantics and announces them as vLLM does."""

from __future__ import annotations

import pytest

from fleet.block_pool import BlockHasher, BlockPool, NoFreeBlocks
from router.index.events import AllBlocksCleared, BlockRemoved, BlockStored

BS = 4


def _cache_sequence(pool: BlockPool, tokens: list[int]) -> tuple[list, list[bytes]]:  # type: ignore[type-arg]
    hashes = BlockHasher().chain(tokens, BS)
    blocks = pool.allocate(len(hashes))
    pool.cache_blocks(blocks, hashes, tokens[: len(hashes) * BS], None)
    return blocks, hashes


def test_hash_chain_covers_full_blocks_only_and_depends_on_the_prefix() -> None:
    hasher = BlockHasher()
    assert len(hasher.chain(list(range(11)), BS)) == 2
    a, b = hasher.chain([1, 2, 3, 4, 5, 6, 7, 8], BS), hasher.chain([9, 9, 9, 9, 5, 6, 7, 8], BS)
    assert a[1] != b[1]  # same tokens in block 1, different parents
    assert BlockHasher("1").chain([1, 2, 3, 4], BS) != hasher.chain([1, 2, 3, 4], BS)


@pytest.mark.parametrize(("int_hashes", "kind"), [(True, int), (False, bytes)])
def test_stored_event_covers_consecutive_blocks(int_hashes: bool, kind: type) -> None:
    pool = BlockPool(8, BS, int_hashes=int_hashes)
    _, hashes = _cache_sequence(pool, list(range(10)))
    [event] = pool.take_events()
    assert isinstance(event, BlockStored)
    assert event.token_ids == list(range(8))
    assert event.parent_block_hash is None
    assert all(type(h) is kind for h in event.block_hashes)
    if int_hashes:
        assert event.block_hashes == [int.from_bytes(h[-8:], "big") for h in hashes]
    else:
        assert event.block_hashes == hashes
    assert (event.block_size, event.medium, event.group_idx) == (BS, "GPU", 0)


def test_finished_blocks_stay_cached_until_reused_and_the_tail_goes_first() -> None:
    pool = BlockPool(7, BS)  # 6 usable: block 0 is the null block
    blocks, hashes = _cache_sequence(pool, list(range(12)))  # 3 blocks
    pool.free(blocks)
    pool.take_events()
    assert pool.cached_prefix(hashes) == blocks
    assert pool.usage == 0.0  # cached but unreferenced blocks count as free, as in vLLM
    pool.allocate(3)  # the 3 never-used blocks go first: no eviction
    assert pool.take_events() == []
    pool.allocate(1)  # then the least recently freed: the sequence's last block
    [removed] = pool.take_events()
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == [pool.wire_hash(hashes[2])]
    assert pool.cached_prefix(hashes) == blocks[:2]


def test_touching_a_free_cached_block_protects_it_from_eviction() -> None:
    pool = BlockPool(4, BS)
    blocks, hashes = _cache_sequence(pool, list(range(8)))
    pool.free(blocks)
    pool.touch(pool.cached_prefix(hashes))
    assert pool.num_free == 1
    pool.allocate(1)
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)
    assert [e for e in pool.take_events() if isinstance(e, BlockRemoved)] == []


def test_one_hash_in_two_blocks_is_stored_twice_and_survives_one_removal() -> None:
    pool = BlockPool(3, BS)
    first, hashes = _cache_sequence(pool, [1, 2, 3, 4])
    second, _ = _cache_sequence(pool, [1, 2, 3, 4])
    assert [type(e) for e in pool.take_events()] == [BlockStored, BlockStored]
    pool.free(first)
    pool.allocate(1)  # evicts the first copy
    assert [type(e) for e in pool.take_events()] == [BlockRemoved]
    assert pool.cached_prefix(hashes) == second


def test_reset_is_refused_while_blocks_are_in_use() -> None:
    pool = BlockPool(4, BS)
    blocks, hashes = _cache_sequence(pool, list(range(8)))
    pool.take_events()
    assert not pool.reset()
    pool.free(blocks)
    assert pool.reset()
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.cached_prefix(hashes) == []


def test_block_zero_is_reserved_like_vllms_null_block() -> None:
    pool = BlockPool(5, BS)
    assert pool.num_free == 4
    assert 0 not in [b.block_id for b in pool.allocate(4)]
    assert pool.usage == 1.0
