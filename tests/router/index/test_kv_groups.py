"""A hybrid model's sliding-window and Mamba groups cut what its full-attention blocks match, as vLLM's own
prefix-cache lookup does (tests/stack/test_hybrid_groups.py checks it against the installed vLLM's)."""

from __future__ import annotations

import msgspec

from router.index.block_index import BlockIndex
from router.index.events import AllBlocksCleared, BlockRemoved, BlockStored
from router.index.kv_groups import GroupConstraints, ending_blocks
from scorers.request import TierMatch
from tests.router.index.test_block_index import BS, TOKENS, prompt, removed, stored, vllm_hash

A, B = ("a", 0), ("b", 0)
FULL, OTHER = 0, 1


def full(first: int, count: int) -> BlockStored:
    return msgspec.structs.replace(stored(first, count), group_idx=FULL, kv_cache_spec_kind="full_attention")


def mamba(*positions: int) -> list[BlockStored]:
    """A Mamba group's state at each position: vLLM announces one block per state it keeps."""
    return [
        msgspec.structs.replace(stored(p, 1), group_idx=OTHER, kv_cache_spec_kind="mamba") for p in positions
    ]


def window(first: int, count: int, tokens: int = 2 * BS + 1) -> BlockStored:
    """A sliding window of tokens: a hit must end with cdiv(tokens - 1, BS) of its blocks (2 here)."""
    return msgspec.structs.replace(
        stored(first, count),
        group_idx=OTHER,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=tokens,
    )


def group_removed(*positions: int) -> BlockRemoved:
    return msgspec.structs.replace(removed(*positions), group_idx=OTHER)


def test_a_mamba_hybrid_reuses_a_prefix_only_up_to_a_state_it_kept() -> None:
    index = BlockIndex(BS)
    index.apply(A, [full(0, 8), *mamba(2, 5)])
    assert index.match(prompt()) == {"a": TierMatch(gpu=6)}  # the state after block 5; 6 and 7 have none
    assert index.match(prompt(TOKENS[: 5 * BS])) == {"a": TierMatch(gpu=3)}  # a shared 5-block prefix: to 2
    assert index.match(prompt([*TOKENS[: 2 * BS], *[7] * 30])) == {}  # shares blocks 0-1: no state there


def test_a_sliding_window_needs_the_blocks_that_end_the_hit() -> None:
    index = BlockIndex(BS)
    index.apply(A, [full(0, 8), window(0, 8)])
    assert index.match(prompt()) == {"a": TierMatch(gpu=8)}
    index.apply(A, [group_removed(0, 1, 2, 3, 4)])  # evicted: outside every later prompt's window
    assert index.match(prompt()) == {"a": TierMatch(gpu=8)}
    index.apply(A, [group_removed(6)])
    # Held: 5 and 7; no two contiguous blocks end a hit anywhere, and blocks 0-1 are gone too.
    assert index.match(prompt()) == {}
    index.apply(A, [window(0, 1)])
    assert index.match(prompt()) == {"a": TierMatch(gpu=1)}  # a hit that starts the prompt needs no more


def test_the_groups_removals_leave_the_full_attention_blocks_alone() -> None:
    index = BlockIndex(BS)
    index.apply(A, [full(0, 4), window(0, 4)])
    index.apply(A, [group_removed(2, 3)])
    assert index.match(prompt(TOKENS[: 2 * BS])) == {"a": TierMatch(gpu=2)}
    index.apply(A, [window(2, 2)])  # the same blocks announced again: the full-attention ones were kept
    assert index.match(prompt(TOKENS[: 4 * BS])) == {"a": TierMatch(gpu=4)}
    index.apply(A, [msgspec.structs.replace(removed(0, 1, 2, 3), group_idx=FULL)])
    assert index.match(prompt(TOKENS[: 4 * BS])) == {}


def test_a_group_announced_before_the_full_attention_blocks_of_its_batch_is_indexed() -> None:
    """Group order is the model's: a Mamba group may be group 0 and come first in a batch."""
    index = BlockIndex(BS)
    first = msgspec.structs.replace(mamba(3)[0], group_idx=0)
    index.apply(A, [first, msgspec.structs.replace(full(0, 6), group_idx=1)])
    assert index.match(prompt()) == {"a": TierMatch(gpu=4)}
    assert index.stats.orphaned == 0


def test_speculative_blocks_count_for_every_group() -> None:
    """A prompt routed there is computed there, every group's blocks with it, before its events come."""
    index = BlockIndex(BS)
    index.apply(A, [full(0, 4), *mamba(1)])
    index.speculate("a", prompt(), start=4)
    assert index.match(prompt()) == {"a": TierMatch(gpu=10)}


def test_a_reset_clears_the_groups_and_an_instance_without_groups_is_untouched() -> None:
    index = BlockIndex(BS)
    index.apply(A, [full(0, 6), *mamba(5)])
    index.apply(B, [stored(0, 6)])
    assert index.match(prompt()) == {"a": TierMatch(gpu=6), "b": TierMatch(gpu=6)}
    index.apply(A, [AllBlocksCleared(), full(0, 6)])  # the full-attention blocks again, no state yet
    assert index.match(prompt()) == {"b": TierMatch(gpu=6)}
    index.apply(A, [*mamba(3)])
    assert index.match(prompt()) == {"a": TierMatch(gpu=4), "b": TierMatch(gpu=6)}
    index.drop(A)
    index.apply(A, [full(0, 6)])
    assert index.match(prompt()) == {"b": TierMatch(gpu=6)}  # a restarted engine keeps its groups' kinds


def test_a_group_block_whose_full_attention_block_is_unknown_is_an_orphan() -> None:
    index = BlockIndex(BS)
    index.apply(A, [full(0, 2), *mamba(4)])
    assert index.stats.orphaned == 1
    assert index.match(prompt()) == {}  # the only state is of a block never seen


def test_blocks_a_window_needs_to_end_a_hit() -> None:
    assert ending_blocks("sliding_window", 128, 16) == 8  # gpt-oss: cdiv(127, 16)
    assert ending_blocks("sliding_window", 4096, 16) == 256
    assert ending_blocks("sliding_window_mla", 17, 16) == 1
    assert ending_blocks("mamba", None, 16) == 1


def test_vllm_hashes_as_bytes_resolve_too() -> None:
    index = BlockIndex(BS)
    events = [
        msgspec.structs.replace(e, block_hashes=[vllm_hash(p, as_bytes=True)], parent_block_hash=None)
        for p, e in [(2, mamba(2)[0])]
    ]
    head = msgspec.structs.replace(
        stored(0, 4, as_bytes=True), group_idx=FULL, kv_cache_spec_kind="full_attention"
    )
    index.apply(A, [head, *events])
    assert index.match(prompt()) == {"a": TierMatch(gpu=3)}


def test_a_group_keeps_no_more_blocks_than_its_bound() -> None:
    groups = GroupConstraints(BS, max_entries=3)
    groups.declare(1, OTHER, "mamba", None)
    groups.store(1, OTHER, [(10, 100), (11, 101)])
    groups.store(1, OTHER, [(12, 102), (13, 103)])  # the oldest, key 10, goes
    chain = [100, 101, 102, 103]
    assert [groups.cut(1, chain, end, {}) for end in (1, 2, 3, 4)] == [0, 2, 3, 4]


def test_a_model_whose_only_group_is_a_sliding_window_keeps_its_blocks_in_the_index() -> None:
    """Nothing to cut it to: its blocks are the index's own, as before groups were known."""
    index = BlockIndex(BS)
    index.apply(A, [window(0, 8)])
    assert index.match(prompt()) == {"a": TierMatch(gpu=8)}
    assert index.stats.orphaned == 0


def test_a_group_of_another_block_size_is_skipped_not_a_cut_to_nothing() -> None:
    index = BlockIndex(BS)
    index.apply(A, [full(0, 8), msgspec.structs.replace(window(0, 2), block_size=2 * BS)])
    assert index.match(prompt()) == {"a": TierMatch(gpu=8)}
    assert index.stats.mismatched == 1


def test_the_hit_is_looked_for_within_the_reusable_blocks() -> None:
    """vLLM looks up the blocks before the last prompt token only: a whole-block prompt's last block cannot
    end the hit, so a state there does not count."""
    index = BlockIndex(BS)
    index.apply(A, [full(0, 10), *mamba(3, 9)])
    assert index.match(prompt()) == {"a": TierMatch(gpu=10)}
    assert index.match(prompt(), reusable=9) == {"a": TierMatch(gpu=4)}


def test_a_group_block_held_in_two_copies_stays_until_both_are_removed() -> None:
    index = BlockIndex(BS)
    index.apply(A, [full(0, 4), *mamba(3), *mamba(3)])  # two physical copies of one state
    index.apply(A, [group_removed(3)])
    assert index.match(prompt()) == {"a": TierMatch(gpu=4)}
    index.apply(A, [group_removed(3)])
    assert index.match(prompt()) == {}
