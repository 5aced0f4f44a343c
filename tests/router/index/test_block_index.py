"""The block index: store, remove, refcounts, tiers, ranks, restarts, bounds and speculative entries."""

from __future__ import annotations

import itertools
import random
import struct
from typing import cast

import msgspec
import pytest
import xxhash

from router.index.block_index import BlockIndex, Tier
from router.index.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from router.prompt import block_hashing
from scorers.request import TierMatch
from tests.conftest import ManualClock

BS = 4
A, B = ("a", 0), ("b", 0)
rng = random.Random(0)
TOKENS = [rng.randrange(1000) for _ in range(40)]  # 10 blocks


def vllm_hash(position: int, salt: int = 0, as_bytes: bool = False) -> int | bytes:
    value = (position + 1) * 1_000_003 + salt * 7 + 2**63  # above 2**63, as vLLM's unsigned ints can be
    return value.to_bytes(32, "big") if as_bytes else value


def stored(
    first: int,
    count: int,
    tokens: list[int] = TOKENS,
    medium: str | None = "GPU",
    salt: int = 0,
    as_bytes: bool = False,
    lora: str | None = None,
) -> BlockStored:
    return BlockStored(
        block_hashes=[vllm_hash(i, salt, as_bytes) for i in range(first, first + count)],
        parent_block_hash=None if first == 0 else vllm_hash(first - 1, salt, as_bytes),
        token_ids=tokens[first * BS : (first + count) * BS],
        block_size=BS,
        lora_id=None,
        medium=medium,
        lora_name=lora,
    )


def removed(*positions: int, medium: str = "GPU", salt: int = 0) -> BlockRemoved:
    return BlockRemoved(block_hashes=[vllm_hash(p, salt) for p in positions], medium=medium)


def prompt(tokens: list[int] = TOKENS) -> list[int]:
    return block_hashing.chain(tokens, BS)


def test_stored_blocks_match_the_same_prompt_and_its_extensions() -> None:
    index = BlockIndex(BS)
    index.apply(A, [stored(0, 6)])
    assert index.match(prompt()) == {"a": TierMatch(gpu=6)}
    assert index.match(prompt(TOKENS[:12])) == {"a": TierMatch(gpu=3)}
    diverging = [*TOKENS[:8], 9999, *TOKENS[9:]]
    assert index.match(prompt(diverging)) == {"a": TierMatch(gpu=2)}
    assert index.match(prompt([7] * 40)) == {}
    assert index.match([]) == {}


def test_chained_events_continue_from_their_parent_in_either_hash_type() -> None:
    for as_bytes in (False, True):
        index = BlockIndex(BS)
        index.apply(A, [stored(0, 3, as_bytes=as_bytes)])
        index.apply(A, [stored(3, 1, as_bytes=as_bytes), stored(4, 2, as_bytes=as_bytes)])
        assert index.match(prompt()) == {"a": TierMatch(gpu=6)}


def test_a_block_whose_parent_is_unknown_is_not_indexed() -> None:
    index = BlockIndex(BS)
    index.apply(A, [stored(3, 2)])
    assert index.match(prompt()) == {}
    assert index.stats.orphaned == 2
    assert index.entries == 0


def test_each_instance_gets_its_own_contiguous_prefix() -> None:
    index = BlockIndex(BS)
    index.apply(A, [stored(0, 8)])
    index.apply(B, [stored(0, 3, salt=1)])  # another engine: other vLLM hashes, same tokens
    assert index.match(prompt()) == {"a": TierMatch(gpu=8), "b": TierMatch(gpu=3)}


def test_removal_cuts_the_prefix_where_the_block_went() -> None:
    index = BlockIndex(BS)
    index.apply(A, [stored(0, 6)])
    index.apply(A, [removed(4)])
    assert index.match(prompt()) == {"a": TierMatch(gpu=4)}
    index.apply(A, [removed(0), removed(77)])  # an unknown hash is ignored
    assert index.match(prompt()) == {}
    assert index.entries == 4


def test_a_block_stored_twice_survives_one_removal() -> None:
    index = BlockIndex(BS)
    index.apply(A, [stored(0, 2), stored(0, 2)])
    index.apply(A, [removed(1)])
    assert index.match(prompt()) == {"a": TierMatch(gpu=2)}
    index.apply(A, [removed(1)])
    assert index.match(prompt()) == {"a": TierMatch(gpu=1)}


@pytest.mark.parametrize("forget", ["all_blocks_cleared", "drop"])
def test_clearing_one_owner_leaves_the_others(forget: str) -> None:
    index = BlockIndex(BS)
    index.apply(A, [stored(0, 5)])
    index.apply(B, [stored(0, 2, salt=1)])
    if forget == "drop":
        index.drop(A)
    else:
        index.apply(A, [AllBlocksCleared()])
    assert index.match(prompt()) == {"b": TierMatch(gpu=2)}
    assert index.entries == 2
    index.apply(A, [stored(0, 1)])  # and it can start again
    assert index.match(prompt())["a"] == TierMatch(gpu=1)


def test_a_prefix_cache_reset_clears_the_gpu_tier_and_offloaded_copies_stay() -> None:
    """A clear alone is the GPU block pool's reset (see below for the CPU's); a restart loses everything."""
    index = BlockIndex(BS)
    index.apply(A, [stored(0, 2), stored(0, 2, medium="CPU")])
    index.apply(A, [AllBlocksCleared()])
    assert index.match(prompt()) == {"a": TierMatch(cpu=2)}
    index.apply(A, [stored(2, 1), stored(2, 1, medium="CPU"), removed(2)])  # computed after its CPU parent
    assert index.match(prompt()) == {"a": TierMatch(cpu=3)}
    assert index.entries == 3
    index.drop(A)
    assert index.match(prompt()) == {}
    assert index.entries == 0


@pytest.mark.parametrize(
    ("batch", "left"),
    [
        # /reset_prefix_cache: the GPU block pool's clear alone
        ([AllBlocksCleared()], TierMatch(cpu=3)),
        # reset_connector with a SimpleCPUOffloadConnector: its CPU block pool's clear follows the GPU's
        ([AllBlocksCleared(), AllBlocksCleared()], None),
        # ... and the GPU's blocks of the next engine step come between them
        ([AllBlocksCleared(), stored(0, 1), AllBlocksCleared()], TierMatch(gpu=1)),
        # the GPU pool's reset failed (requests running): the connector's clear follows its offloads
        ([stored(3, 1), stored(3, 1, medium="CPU"), AllBlocksCleared()], TierMatch(gpu=4)),
        ([removed(2), removed(2, medium="STORAGE"), AllBlocksCleared()], TierMatch(gpu=2)),
    ],
)
def test_a_clear_after_the_gpu_block_pools_events_is_the_offload_connectors(
    batch: list[KVEvent], left: TierMatch | None
) -> None:
    """AllBlocksCleared names no medium (vLLM 0.32); a SimpleCPUOffloadConnector's reset sends one from its CPU
    block pool, among the connector's events, which the scheduler publishes after the GPU block pool's."""
    index = BlockIndex(BS)
    index.apply(A, [stored(0, 3), stored(0, 3, medium="CPU")])
    index.apply(A, batch)
    assert index.match(prompt()).get("a") == left


def test_tiers_are_credited_to_the_best_copy() -> None:
    index = BlockIndex(BS)
    index.apply(A, [stored(0, 4), stored(0, 4, medium="CPU"), removed(2, 3)])  # one engine: one vLLM hash
    assert index.match(prompt()) == {"a": TierMatch(gpu=2, cpu=2)}
    index.apply(A, [removed(0)])
    assert index.match(prompt()) == {"a": TierMatch(gpu=1, cpu=3)}
    index.apply(A, [removed(0, medium="CPU")])
    assert index.match(prompt()) == {}


def placeholder(position: int, as_bytes: bool = False) -> BlockStored:
    """What vLLM's OffloadingConnector announces by default (self_describing_kv_events off): a key alone."""
    return BlockStored(
        block_hashes=[vllm_hash(position, as_bytes=as_bytes)],
        parent_block_hash=None,
        token_ids=[],
        block_size=0,
        lora_id=None,
        medium="CPU",
        lora_name=None,
        group_idx=0,
    )


@pytest.mark.parametrize("as_bytes", [False, True])
def test_offloaded_blocks_announced_without_tokens_take_the_owners_own_copy(as_bytes: bool) -> None:
    index = BlockIndex(BS)
    offloaded = [placeholder(p, as_bytes) for p in (0, 1, 1, 7)]  # 1 twice; 7 never seen with tokens
    index.apply(A, [stored(0, 3, as_bytes=as_bytes), *offloaded])
    assert (index.stats.orphaned, index.stats.mismatched) == (1, 0)
    index.apply(A, [removed(0, 1, 2)])  # the GPU copies go
    assert index.match(prompt()) == {"a": TierMatch(cpu=2)}
    index.apply(A, [removed(1, medium="CPU")])
    assert index.match(prompt()) == {"a": TierMatch(cpu=2)}
    index.apply(A, [removed(1, medium="CPU")])
    assert index.match(prompt()) == {"a": TierMatch(cpu=1)}
    assert index.entries == 1


def with_keys(event: BlockStored, lora: str | None, salt: str | None) -> BlockStored:
    """event with the extra keys vLLM's GPU block pool announces: the adapter's name in every block's, the
    cache salt (after it) in the first block's."""
    extra: list[object] = [None if lora is None else (lora,) for _ in event.block_hashes]
    if salt and event.parent_block_hash is None:
        extra[0] = (*(extra[0] or ()), salt)
    return msgspec.structs.replace(event, extra_keys=extra)


@pytest.mark.parametrize(("lora", "salt"), [("sql", None), ("sql", "tenant-a"), (None, "tenant-a")])
def test_offloaded_copies_of_an_adapters_or_salted_blocks_count_for_that_prompt_only(
    lora: str | None, salt: str | None
) -> None:
    """vLLM 0.32's OffloadingConnector (self_describing_kv_events) announces offloads with the tokens but
    without the request's extra keys (offloading/events.py: extra_keys=None): hashed from their tokens, they
    would be the base model's plain prompt. They carry their GPU copies' vLLM hashes, announced with the keys."""
    index = BlockIndex(BS)
    index.apply(A, [with_keys(stored(0, 4, lora=lora), lora, salt), stored(0, 4, medium="CPU", lora=lora)])
    index.apply(A, [removed(0, 1, 2, 3)])  # the GPU copies go; the CPU ones stay
    own = block_hashing.prompt_chain(TOKENS, BS, block_hashing.prompt_key(salt, lora))
    assert index.match(own) == {"a": TierMatch(cpu=4)}
    assert index.match(prompt()) == {}  # the base model's plain prompt is not offloaded
    assert index.match(block_hashing.chain(TOKENS, BS, block_hashing.root_for(lora))) == {}


def test_offloads_without_extra_keys_whose_gpu_copies_are_unknown_are_not_guessed() -> None:
    """Salted or not, an offload without its extra keys cannot be hashed from its tokens; one that states its
    keys (vLLM's SimpleCPUOffloadConnector) is hashed as the GPU's own blocks are."""
    index = BlockIndex(BS)
    index.apply(A, [stored(0, 2, medium="CPU")])
    assert (index.match(prompt()), index.stats.orphaned) == ({}, 2)
    index.apply(A, [with_keys(stored(0, 2, medium="CPU", salt=1), None, "tenant-a")])
    salted = block_hashing.prompt_chain(TOKENS, BS, block_hashing.prompt_key("tenant-a"))
    assert index.match(salted) == {"a": TierMatch(cpu=2)}
    index.apply(A, [stored(0, 3, medium="CPU", tokens=TOKENS[:5])])  # a mismatch is counted, not indexed
    assert (index.stats.mismatched, index.entries) == (1, 2)


def test_gpu_cpu_and_speculative_entries_combine() -> None:
    index = BlockIndex(BS)
    index.apply(A, [stored(0, 4), stored(0, 4, medium="CPU"), removed(2, 3)])
    index.speculate("a", prompt(), start=4)
    index.apply(B, [stored(0, 3, salt=1)])
    assert index.match(prompt()) == {"a": TierMatch(gpu=8, cpu=2), "b": TierMatch(gpu=3)}


def test_ranks_of_one_instance_are_kept_apart_and_the_best_counts() -> None:
    index = BlockIndex(BS)
    index.apply(("a", 0), [stored(0, 2)])
    index.apply(("a", 1), [stored(0, 5, salt=1)])
    assert index.match(prompt()) == {"a": TierMatch(gpu=5)}
    index.drop(("a", 1))
    assert index.match(prompt()) == {"a": TierMatch(gpu=2)}


def test_lora_adapters_are_separate_cache_entries() -> None:
    index = BlockIndex(BS)
    index.apply(A, [stored(0, 3, lora="sql")])
    assert index.match(prompt()) == {}
    assert index.match(block_hashing.chain(TOKENS, BS, block_hashing.root_for("sql"))) == {
        "a": TierMatch(gpu=3)
    }


def test_events_that_do_not_fit_are_counted_and_skipped_without_losing_their_batch() -> None:
    index = BlockIndex(8)
    index.apply(A, [stored(0, 2)])  # block_size 4 events, index of 8-token blocks
    assert index.entries == 0
    assert index.stats.mismatched == 1
    index = BlockIndex(BS)
    empty = BlockStored(
        block_hashes=[],
        parent_block_hash=None,
        token_ids=[],
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    huge_token = stored(0, 1, tokens=[2**40] * BS)
    short_extras = BlockStored(**{**msgspec.structs.asdict(stored(0, 2)), "extra_keys": [None]})
    index.apply(A, [empty, huge_token, short_extras, stored(0, 3)])
    assert index.stats.mismatched == 2
    assert index.match(prompt()) == {"a": TierMatch(gpu=3)}


def test_memory_is_bounded_and_chains_lose_their_tails_first() -> None:
    index = BlockIndex(BS, max_entries=8)
    index.apply(A, [stored(0, 6)])
    index.apply(B, [stored(0, 6, salt=1)])
    assert index.entries == 8
    assert index.stats.evicted == 4
    matches = index.match(prompt())
    assert sum(m.gpu for m in matches.values()) == 8
    assert all(m.gpu >= 4 for m in matches.values())  # tails went, roots stayed


@pytest.mark.parametrize(("reused", "hot_kept", "cold_kept"), [(0, 2, 6), (3, 3, 5)])
def test_a_prefix_routed_for_reuse_outlives_the_bound_as_vllm_keeps_it(
    reused: int, hot_kept: int, cold_kept: int
) -> None:
    """Stored first, a shared prefix is the instance's oldest entry; routed to since, it is a recently used
    one, and the other chain's tail goes in its place."""
    index = BlockIndex(BS, max_entries=8)
    index.apply(A, [stored(0, 6)])
    index.reused("a", prompt(), reused)
    index.apply(A, [stored(0, 6, tokens=OTHER_TOKENS, salt=1)])
    assert index.entries == 8 and index.stats.evicted == 4
    assert index.match(prompt()) == {"a": TierMatch(gpu=hot_kept)}
    assert index.match(prompt(OTHER_TOKENS)) == {"a": TierMatch(gpu=cold_kept)}


def test_a_key_stored_again_with_other_content_is_counted_once_and_leaves_nothing_behind() -> None:
    """An inconsistent publisher, or two bytes hashes sharing their low 64 bits: the first content stays."""
    index = BlockIndex(BS)
    index.apply(A, [stored(0, 1), stored(0, 1, tokens=OTHER_TOKENS)])
    assert index.entries == 1
    assert index.match(prompt()) == {"a": TierMatch(gpu=1)}
    assert index.match(prompt(OTHER_TOKENS)) == {}
    index.apply(A, [removed(0), removed(0)])
    assert index.entries == 0
    assert index.match(prompt()) == index.match(prompt(OTHER_TOKENS)) == {}


def test_a_drifted_entry_count_is_resynced_before_evicting(caplog: pytest.LogCaptureFixture) -> None:
    """Evicting by a count above the maps' size cuts too much, and past their size never ends."""
    index = BlockIndex(BS, max_entries=10)
    index.apply(A, [stored(0, 6)])
    index._holdings.entries += 5  # a bookkeeping slip
    index.apply(B, [stored(0, 6, salt=1)])
    assert index.entries == sum(map(sum, index.entries_by_owner().values())) == 10
    index._holdings.entries += 5
    index.apply(B, [stored(6, 1, salt=1)])
    assert index.entries == sum(map(sum, index.entries_by_owner().values())) == 10
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1


def test_speculative_entries_count_until_they_expire() -> None:
    now = [100.0]
    index = BlockIndex(BS, speculative_ttl_s=2.0, clock=lambda: now[0])
    index.apply(A, [stored(0, 2)])
    index.speculate("b", prompt())
    assert index.match(prompt()) == {"a": TierMatch(gpu=2), "b": TierMatch(gpu=10)}
    now[0] = 101.5
    index.speculate("b", prompt()[:4])  # a second request renews the first four blocks
    now[0] = 102.5
    assert index.match(prompt()) == {"a": TierMatch(gpu=2), "b": TierMatch(gpu=4)}
    now[0] = 104.0
    assert index.match(prompt()) == {"a": TierMatch(gpu=2)}


def test_a_withdrawn_speculation_goes_at_once_and_leaves_others_alone() -> None:
    """A request the instance refused or failed: its speculative blocks stop counting before their
    deadline; other instances' speculation of the same blocks and the instance's stored blocks stay."""
    index = BlockIndex(BS, speculative_ttl_s=2.0, clock=ManualClock(100.0))
    index.apply(A, [stored(0, 2)])
    entered = index.speculate("a", prompt(), start=2)
    index.speculate("b", prompt())
    assert entered.blocks == prompt()[2:]
    index.withdraw("a", entered)
    assert index.match(prompt()) == {"a": TierMatch(gpu=2), "b": TierMatch(gpu=10)}
    index.withdraw("c", entered)  # an instance the index never saw: nothing to take back
    index.withdraw("b", index.speculate("b", prompt()))  # speculated twice: withdrawn whole
    assert index.match(prompt()) == {"a": TierMatch(gpu=2)}


def test_a_request_speculated_after_a_withdrawn_one_keeps_its_own_deadline() -> None:
    clock = ManualClock(100.0)
    index = BlockIndex(BS, speculative_ttl_s=2.0, clock=clock)
    index.withdraw("a", index.speculate("a", prompt()))  # refused at 100
    clock.now = 101.0
    index.speculate("a", prompt())  # the client's retry, due until 103
    clock.now = 102.5  # past the withdrawn one's deadline
    assert index.match(prompt()) == {"a": TierMatch(gpu=10)}
    clock.now = 103.0
    assert index.match(prompt()) == {}
    assert index._speculations.settled()  # nothing left behind
    late = index.speculate("a", prompt())
    clock.now = 106.0
    index.withdraw("a", late)  # an error that came after its deadline: nothing of it is left to take back
    assert not any(index._speculations._respeculated.values())  # its withdrawal noted no deadline


@pytest.mark.parametrize("seed", range(4))
def test_a_speculative_block_counts_while_its_latest_deadline_is_ahead(seed: int) -> None:
    """Random requests and clock steps against a model: (block, instance) -> latest deadline; chains share
    prefixes and repeat blocks, and the clock lands on deadlines exactly."""
    rng = random.Random(seed)
    clock = ManualClock(100.0)
    index = BlockIndex(BS, speculative_ttl_s=2.0, clock=clock)
    chains = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9], [7, 7, 8, 7], [1, 2], [5, 6, 1]]
    deadlines: dict[tuple[int, str], float] = {}
    for _ in range(300):
        if rng.random() < 0.4:
            clock.now += rng.choice([0.5, 1.0, 2.0])
        chain, instance = rng.choice(chains), rng.choice("abc")
        start = rng.randrange(len(chain) + 1)
        index.speculate(instance, chain, start=start)
        deadlines.update({(block, instance): clock.now + 2.0 for block in chain[start:]})
        probe = rng.choice(chains)
        alive = {name: [deadlines.get((block, name), 0) > clock.now for block in probe] for name in "abc"}
        held = {name: len(list(itertools.takewhile(bool, flags))) for name, flags in alive.items()}
        assert index.match(probe) == {name: TierMatch(gpu=n) for name, n in held.items() if n}
    clock.now += 2.0
    assert index.match(chains[0]) == {}
    assert index._speculations.settled()  # nothing left behind


OTHER_TOKENS = [t + 1000 for t in TOKENS]


def pooled(
    first: int, count: int, salt: int = 0, tokens: list[int] = TOKENS, with_tokens: bool = True
) -> BlockStored:
    """What the MooncakeStoreConnector announces after writing blocks to the pool: medium "cpu", bytes
    hashes (the same as the GPU copy's), and its token ids unless it could not tell them."""
    event = stored(first, count, tokens, medium="cpu", salt=salt, as_bytes=True)
    return event if with_tokens else msgspec.structs.replace(event, token_ids=[])


@pytest.mark.parametrize(("lora", "salt"), [("sql", None), ("sql", "tenant-a"), (None, "tenant-a")])
def test_pool_writes_of_an_adapters_or_salted_blocks_count_for_that_prompt_only(
    lora: str | None, salt: str | None
) -> None:
    """vLLM's store worker announces a pool write with the tokens but without the request's extra keys (as
    captured from vLLM 0.32): hashed from its tokens, it would be the base model's plain prompt. The writer's
    own cache announced the blocks first, with their keys, under the same vLLM hashes."""
    extra: list[object] = [None if lora is None else (lora,) for _ in range(4)]
    if salt:
        extra[0] = (*(extra[0] or ()), salt)
    gpu = msgspec.structs.replace(stored(0, 4, as_bytes=True, lora=lora), extra_keys=extra)
    index = BlockIndex(BS)
    index.join_pool("b")
    index.apply(A, [gpu, pooled(0, 4)])
    own = block_hashing.prompt_chain(TOKENS, BS, block_hashing.prompt_key(salt, lora))
    assert index.match(own) == {"a": TierMatch(gpu=4), "b": TierMatch(pool=4)}
    assert index.match(prompt()) == {}  # the base model's plain prompt is not in the pool


def test_a_lookup_in_flight_loses_the_blocks_stored_again_while_it_lasts() -> None:
    index = BlockIndex(BS)
    index.apply(A, [stored(0, 2, as_bytes=True), pooled(0, 2)])
    hashes = [vllm_hash(p, as_bytes=True) for p in (0, 1)]
    with index.asking(hashes) as first:
        with index.asking(hashes) as second:  # an equal lookup, begun and ended meanwhile
            pass
        index.apply(A, [pooled(1, 1)])
        assert first == {hashes[0]}
    assert second == set(hashes)
    index.apply(A, [pooled(0, 1)])  # no lookup left to tell
    assert first == {hashes[0]}


def test_pool_blocks_count_for_every_instance_that_writes_to_the_pool() -> None:
    index = BlockIndex(BS)
    index.apply(A, [stored(0, 3, as_bytes=True), pooled(0, 7)])
    index.apply(B, [pooled(0, 2, salt=9, tokens=OTHER_TOKENS)])  # B writes something else: connected too
    index.apply(("c", 0), [stored(0, 2, salt=3)])  # C never wrote to the pool
    assert index.match(prompt()) == {
        "a": TierMatch(gpu=3, pool=4),
        "b": TierMatch(pool=7),
        "c": TierMatch(gpu=2),
    }
    assert index.pool_members() == ["a", "b"]
    assert index.pool_entries == 9
    assert index.match(prompt(), include_pool=False) == {"a": TierMatch(gpu=3), "c": TierMatch(gpu=2)}
    index.join_pool("d")  # configured as connected to the pool, before it has written anything there
    assert index.match(prompt())["d"] == TierMatch(pool=7)


def test_pool_blocks_count_only_for_members_of_the_pool_name_they_were_written_under() -> None:
    """Two models of one tokenizer and one Mooncake pool (an 8B and a 70B): their token hashes and vLLM's
    block hashes are the same, their pool objects are not, as Mooncake keys carry the model's name."""
    index = BlockIndex(BS)
    for instance, pool_name in (("a", "m8"), ("a2", "m8"), ("b", "m70")):
        index.set_pool_name(instance, pool_name)
        index.join_pool(instance)
    index.apply(A, [stored(0, 2, as_bytes=True), pooled(0, 6)])
    assert index.match(prompt()) == {"a": TierMatch(gpu=2, pool=4), "a2": TierMatch(pool=6)}
    assert index.pooled(prompt(), 0, 10, "m70") == []
    index.apply(B, [pooled(0, 3)])  # the 70B's own objects for the first blocks
    assert index.match(prompt()) == {
        "a": TierMatch(gpu=2, pool=4),
        "a2": TierMatch(pool=6),
        "b": TierMatch(pool=3),
    }
    assert index.pool_entries == 9
    hashes = [cast(bytes, vllm_hash(p, as_bytes=True)) for p in range(6)]
    assert index.pooled(prompt(), 0, 10, "m70") == list(enumerate(hashes[:3]))
    index.forget_pooled(hashes, "m70")  # the master has none of them under the 70B's name
    assert index.match(prompt()) == {"a": TierMatch(gpu=2, pool=4), "a2": TierMatch(pool=6)}
    assert index.pooled(prompt(), 0, 10, "m8") == list(enumerate(hashes))


def test_an_instance_given_another_pool_name_takes_its_membership_along() -> None:
    index = BlockIndex(BS)
    index.set_pool_name("a", "m8")
    index.apply(A, [pooled(0, 4)])
    index.apply(B, [pooled(0, 2, salt=9, tokens=OTHER_TOKENS)])  # b wrote before it had a pool name
    assert index.match(prompt()) == {"a": TierMatch(pool=4)}
    assert index.match(prompt(OTHER_TOKENS)) == {"b": TierMatch(pool=2)}
    index.set_pool_name("b", "m8")  # a reload: b serves the 8B now
    assert index.match(prompt()) == {"a": TierMatch(pool=4), "b": TierMatch(pool=4)}
    assert index.match(prompt(OTHER_TOKENS)) == {}  # the unnamed pool's blocks have no member left
    index.set_pool_name("a", "m70")
    assert index.match(prompt()) == {"b": TierMatch(pool=4)}
    index.leave_pool("b")  # b left the fleet
    assert index.match(prompt()) == {}
    assert index.pool_members() == ["a"]
    assert (index.pool_name("a"), index.pool_name("b")) == ("m70", "")


def test_pool_blocks_announced_without_tokens_take_the_publishers_own_copy() -> None:
    index = BlockIndex(BS)
    index.apply(A, [stored(0, 4, as_bytes=True), pooled(0, 6, with_tokens=False)])
    assert index.match(prompt(), include_pool=True)["a"] == TierMatch(gpu=4)  # 4, 5: never seen with tokens
    assert index.stats.orphaned == 2
    index.apply(A, [removed(0, 1, 2, 3)])
    index.apply(A, [AllBlocksCleared()])
    assert index.match(prompt()) == {"a": TierMatch(pool=4)}  # the pool outlives the publisher's own cache


def test_pool_keys_stay_with_their_blocks_when_the_publisher_no_longer_knows_one() -> None:
    index = BlockIndex(BS)
    index.apply(A, [stored(0, 3, as_bytes=True), removed(0), pooled(0, 3, with_tokens=False)])
    hashes = [vllm_hash(p, as_bytes=True) for p in range(3)]
    assert index.stats.orphaned == 1
    assert index.pooled(prompt(), 0, 3) == [(1, hashes[1]), (2, hashes[2])]


def test_pool_entries_are_kept_once_and_forgotten_on_the_masters_word() -> None:
    index = BlockIndex(BS)
    index.apply(A, [pooled(0, 5)])
    index.apply(B, [pooled(0, 5)])  # the same objects again: one entry each
    assert index.pool_entries == 5
    hashes = [vllm_hash(p, as_bytes=True) for p in range(5)]
    assert index.pooled(prompt(), 3, 9) == [(3, hashes[3]), (4, hashes[4])]
    index.forget_pooled([cast(bytes, hashes[2])])
    assert index.match(prompt()) == {"a": TierMatch(pool=2), "b": TierMatch(pool=2)}
    assert index.pooled(prompt(), 0, 10) == [(0, hashes[0]), (1, hashes[1]), (3, hashes[3]), (4, hashes[4])]
    index.drop(A)
    assert index.match(prompt())["a"] == TierMatch(pool=2)


def test_pool_blocks_with_integer_hashes_have_no_key_and_are_skipped() -> None:
    index = BlockIndex(BS)
    index.apply(A, [stored(0, 3, medium="cpu"), stored(0, 2)])
    assert index.stats.unkeyed == 3
    assert index.match(prompt()) == {"a": TierMatch(gpu=2)}


def test_the_bound_covers_the_pool() -> None:
    index = BlockIndex(BS, max_entries=6)
    index.apply(A, [stored(0, 4, as_bytes=True), pooled(0, 10)])
    assert index.entries <= 6
    assert index.pool_entries + sum(map(sum, index.entries_by_owner().values())) == index.entries
    assert len(index.pooled(prompt(), 0, 10)) == index.pool_entries


@pytest.mark.parametrize("seed", range(40))
def test_random_event_sequences_agree_with_a_reference_model(seed: int) -> None:
    """Refcounts never go negative, removed blocks never match, orphans are never indexed: the index's
    matches equal those of a plain model of per-owner refcounts, after every event."""
    r = random.Random(seed)
    index = BlockIndex(BS)
    model: dict[tuple[str, int], dict[int, int]] = {A: {}, B: {}}
    for _ in range(80):
        owner = r.choice([A, B])
        held = model[owner]
        kind = r.random()
        if kind < 0.5:
            first, count = (r.randrange(1, 6) if r.random() < 0.4 else 0), r.randrange(1, 5)
            index.apply(owner, [stored(first, count)])
            if first == 0 or held.get(first - 1, 0) > 0:
                for position in range(first, first + count):
                    held[position] = held.get(position, 0) + 1
        elif kind < 0.92:
            position = r.randrange(0, 9)
            index.apply(owner, [removed(position)])
            if held.get(position, 0) > 0:
                held[position] -= 1
        else:
            index.apply(owner, [AllBlocksCleared()])
            held.clear()
        expected = {}
        for (name, _), counts in model.items():
            length = 0
            while counts.get(length, 0) > 0 and length < 10:
                length += 1
            if length:
                expected[name] = TierMatch(gpu=length)
        assert index.match(prompt()) == expected
        assert index.entries == sum(1 for counts in model.values() for c in counts.values() if c > 0)


@pytest.mark.parametrize("bound", [1, 5, 17])
def test_bounded_index_stays_within_its_bound_under_random_events(bound: int) -> None:
    r = random.Random(bound)
    index = BlockIndex(BS, max_entries=bound)
    for _ in range(200):
        owner = r.choice([A, B, ("c", 1)])
        index.apply(
            owner, [stored(0, r.randrange(1, 10))] if r.random() < 0.7 else [removed(r.randrange(10))]
        )
        assert 0 <= index.entries <= bound
        assert index.entries == sum(sum(sizes) for sizes in index.entries_by_owner().values())


@pytest.mark.parametrize("length", [0, 3, 4, 13, 64, 67])
def test_block_hashes_are_xxh3_of_uint32_ids_seeded_with_the_parent(length: int) -> None:
    tokens = [r * 2_654_435_761 % 2**32 for r in range(length)]
    expected, parent = [], 77
    for start in range(0, length - BS + 1, BS):
        parent = xxhash.xxh3_64_intdigest(struct.pack(f"<{BS}I", *tokens[start : start + BS]), parent)
        expected.append(parent)
    assert block_hashing.chain(tokens, BS, 77) == expected
    assert block_hashing.prompt_chain(tokens, BS, block_hashing.PromptKey(77)) == expected


def test_a_prompts_chain_takes_its_token_ids_in_any_sequence_and_refuses_ids_out_of_uint32() -> None:
    tokens = list(range(40))
    assert block_hashing.prompt_chain(tuple(tokens), BS) == block_hashing.prompt_chain(tokens, BS)
    assert block_hashing.prompt_chain(tokens[: BS - 1], BS) == []
    for bad in (-1, 2**32):
        with pytest.raises(OverflowError):
            block_hashing.prompt_chain([*tokens[:-1], bad], BS)


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_a_prompts_chain_keys_an_adapters_prompts_as_the_engines_events_do(salt: str | None) -> None:
    """A LoRA request's prompt equals the hashes its events give: the adapter's root, its name before every
    block, the salt on the first."""
    r = random.Random(6)
    history: list[int] = []
    for _ in range(6):
        history += [r.randrange(500) for _ in range(r.randrange(1, 30))]
        count = len(history) // BS
        extra: list[object] = [("sql",)] * count
        if salt and count:
            extra[0] = ("sql", salt)
        events = block_hashing.chain(history, BS, block_hashing.root_for("sql"), extra)
        assert block_hashing.prompt_chain(history, BS, block_hashing.prompt_key(salt, "sql")) == events
        assert block_hashing.prompt_chain(history, BS, block_hashing.prompt_key(salt)) != events or not events
        other = block_hashing.chain(history, BS, block_hashing.root_for("chat"), [("chat",)] * count)
        assert block_hashing.prompt_chain(history, BS, block_hashing.prompt_key(None, "chat")) == other


def test_all_blocks_cleared_clears_where_the_gpus_blocks_are_kept_whatever_the_tier_map() -> None:
    """A configured tier map without a "GPU" key: blocks announced with no medium are the GPU's, and a
    prefix cache reset must clear them, not the CPU copies."""
    index = BlockIndex(BS, medium_tiers={None: Tier.GPU, "CPU": Tier.CPU, "cpu": Tier.POOL})
    index.apply(("a", 0), [stored(0, 2, medium=None), stored(0, 2, medium="CPU")])
    index.apply(("a", 0), [AllBlocksCleared()])
    assert index.match(prompt()) == {"a": TierMatch(cpu=2)}


def test_an_instance_that_left_gives_its_bit_to_the_next_and_leaves_it_nothing() -> None:
    now = [100.0]
    index = BlockIndex(BS, speculative_ttl_s=2.0, clock=lambda: now[0])
    index.apply(("keep", 0), [stored(0, 2)])
    for generation in range(200):  # pods renamed at every rollout
        name = f"pod-{generation}"
        index.apply((name, 0), [stored(0, 6), pooled(0, 8)])
        index.speculate(name, prompt())
        assert index.match(prompt())[name] == TierMatch(gpu=10)
        index.forget_instance(name)
        assert name not in index.match(prompt())
    holdings = index._holdings
    assert (holdings.owner_at.keys(), holdings.free_bits) == ({0}, [2])  # every pod had bit 2 in turn
    # The next one takes that bit, and none of what its last holder had: entries, pool credit, speculation.
    index.apply(("new", 0), [stored(0, 1)])
    assert index.match(prompt()) == {"keep": TierMatch(gpu=2), "new": TierMatch(gpu=1)}
    now[0] = 103.0  # past the last pod's speculation: its expiry record is gone and touches nothing
    index.speculate("new", prompt(), start=1)
    assert index.match(prompt()) == {"keep": TierMatch(gpu=2), "new": TierMatch(gpu=10)}
