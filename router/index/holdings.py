"""Who holds which block, in which tier: the block index's tables, their entry count and its bound.

Layout, chosen for lookup speed and memory:
- per tier, one table from kvroute's block hash to a bitmask of the owners holding it, so matching a prompt
  costs one probe per block for the whole fleet, however many instances it has;
- per owner and tier, a table from vLLM's block hash (low 64 bits) to kvroute's hash packed with a reference
  count, so BlockRemoved resolves and a block stored twice survives one removal.
The tables are U64Maps (router/index/_u64map.pyx, compiled): insertion-ordered dicts of 64-bit keys and
integer values in C arrays, a third of a dict's memory.
An owner is (instance, data parallel rank): ranks publish separately and are cleared separately.
Entries are bounded: past max_entries, the least recently stored entries of the largest owner go first,
but one a request was routed to reuse since gets a second chance (an approximation of vLLM's LRU, which
keeps a hot shared prefix however long ago it was stored).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import cast

from router.index._u64map import COUNT_BITS as COUNT_BITS  # re-exported: what the packed entries use
from router.index._u64map import U64Map, enter_new, store_along, u64_key, u64_keys
from router.index.events import BlockHash, BlockStored

log = logging.getLogger(__name__)

Owner = tuple[str, int]
"""(instance name, data parallel rank)"""

COUNT_MASK = (1 << COUNT_BITS) - 1


class Tier(IntEnum):
    GPU = 0
    CPU = 1
    POOL = 2


# vLLM's own tiers are upper case; the MooncakeStoreConnector announces what it wrote to the pool as "cpu".
DEFAULT_MEDIUM_TIERS: Mapping[str | None, Tier] = {
    None: Tier.GPU,
    "GPU": Tier.GPU,
    "CPU": Tier.CPU,
    "STORAGE": Tier.CPU,
    "cpu": Tier.POOL,
}


# vLLM's hash as a 64-bit key: integers by their two's complement's low 64 bits (vLLM's are unsigned 64-bit,
# kept as they are), bytes by their last 8; vllm_keys: a list of them.
vllm_key, vllm_keys = u64_key, u64_keys


@dataclass
class OwnerState:
    bit: int
    # per tier: vLLM key -> kvroute hash << 16 | refcount
    blocks: tuple[U64Map, ...] = field(default_factory=lambda: tuple(U64Map() for _ in Tier))
    used: set[int] = field(default_factory=set)  # kvroute hashes routed here for reuse since the bound passed

    def size(self) -> int:
        return sum(len(b) for b in self.blocks)


@dataclass
class PoolState(OwnerState):
    """One pool name's share of the pool: its bit is the mask of its members (router/index/pool_tier.py)."""

    name: str = ""
    hashes: dict[int, bytes] = field(default_factory=dict)  # kvroute hash -> vLLM's full hash (Mooncake key)
    # one per lookup on the master in flight: the vLLM hashes it asks about and that were not stored since
    asked: list[set[bytes]] = field(default_factory=list)


@dataclass
class IndexStats:
    stored: int = 0
    removed: int = 0
    orphaned: int = 0  # blocks whose parent (or, announced without tokens, own copy) the index never saw
    evicted: int = 0  # dropped to stay within max_entries
    mismatched: int = 0  # events whose token count or block size does not fit the configured block size
    unkeyed: int = 0  # pool blocks announced with integer hashes: no Mooncake key can be built from them


class Holdings:
    """The holder masks per tier, the owners' entries and bits, and the count of entries within its bound.

    Its fields are the index's shared tables, read and written in place by the index's other parts (storing
    a batch, matching a prompt, the pool tier), which may keep references to them: its dicts and lists are
    never rebound.
    """

    def __init__(self, max_entries: int, stats: IndexStats) -> None:
        self.max_entries = max_entries
        self.stats = stats
        self.holders: tuple[U64Map, ...] = tuple(U64Map() for _ in Tier)  # kvroute hash -> owner mask
        self.owners: dict[Owner, OwnerState] = {}
        # By the position of their bit (bit = 1 << position): matching finds owners by position, and in a
        # large fleet making the bits as ints, 1,000 bits wide, cost a third of a match.
        self.owner_at: dict[int, Owner] = {}
        self.free_bits: list[int] = []  # of owners forgotten, for the next ones
        self.entries = 0
        self._warned_drift = False

    def owner(self, owner: Owner) -> OwnerState:
        state = self.owners.get(owner)
        if state is None:
            # Bits in use and free ones are always the lowest len(owners) + len(free) bits.
            bit = self.free_bits.pop() if self.free_bits else 1 << len(self.owners)
            state = self.owners[owner] = OwnerState(bit)
            self.owner_at[bit.bit_length() - 1] = owner
        return state

    def of_instance(self, instance: str) -> list[OwnerState]:
        """Every rank of instance."""
        return [state for (name, _), state in self.owners.items() if name == instance]

    def bits_of(self, instance: str) -> int:
        """The bits of every rank of instance."""
        return sum(state.bit for (name, _), state in self.owners.items() if name == instance)

    def retire(self, instance: str) -> list[int]:
        """Forget instance's owners (their entries gone already): their bits, freed for the next owners."""
        bits = []
        for owner in [o for o in self.owners if o[0] == instance]:
            bit = self.owners.pop(owner).bit
            del self.owner_at[bit.bit_length() - 1]
            self.free_bits.append(bit)
            bits.append(bit)
        return bits

    def find(self, state: OwnerState, key: int, pool: PoolState) -> int | None:
        """A block's packed entry by vLLM key, in any tier of state or in pool: a parent may be either."""
        for blocks in (*state.blocks, pool.blocks[Tier.POOL]):
            packed = blocks.get(key)
            if packed is not None:
                return packed
        return None

    def store(self, state: OwnerState, tier: Tier, keys: list[int], own: list[int], counted: bool) -> None:
        """Enter blocks for state by their vLLM keys (vllm_key), of kvroute hashes own, the last one first;
        counted=False keeps a block stored twice at one reference."""
        blocks, holders, bit = state.blocks[tier], self.holders[tier], state.bit
        # Blocks no one holds, under keys the owner does not use: the common case, entered in C, tail first
        # (see below). A key in use with other content (an inconsistent publisher, a 64-bit collision) must
        # take the per-block path: overwritten, it would be counted twice and its old hash kept.
        if enter_new(holders, blocks, own, keys, bit):
            self.entries += len(own)
            self.stats.stored += len(own)
            return
        pop, held = blocks.pop, holders.get
        bump = 1 if counted else 0
        added = 0
        # Tail first: the bound drops an owner's oldest-inserted entries first, and like vLLM's eviction it
        # should cut chains from their ends, not their roots. Re-inserting makes an entry the newest.
        for index in range(len(own) - 1, -1, -1):
            key, own_hash = keys[index], own[index]
            packed = pop(key, None)
            if packed is None:
                added += 1
                holders[own_hash] = held(own_hash, 0) | bit
                blocks[key] = (own_hash << COUNT_BITS) + 1
            else:
                blocks[key] = packed + bump if packed & COUNT_MASK != COUNT_MASK else packed
        self.entries += added
        self.stats.stored += len(own)

    def store_along(
        self, state: OwnerState, tier: Tier, event: BlockStored, pool: PoolState, size: int
    ) -> bool:
        """store of a store event's blocks of size tokens, hashed along their parent's chain (in state or in
        pool), in one compiled call where they are what every engine step sends: all new, no adapter nor
        extra keys. False, with nothing changed, for any other, which the caller's general path takes."""
        entered = store_along(
            self.holders[tier],
            state.blocks[tier],
            state.blocks,
            pool.blocks[Tier.POOL],
            event,
            size,
            state.bit,
        )
        self.entries += entered
        self.stats.stored += entered
        return entered > 0

    def store_known(
        self,
        publisher: OwnerState,
        state: OwnerState,
        tier: Tier,
        vllm_hashes: Sequence[BlockHash],
        pool: PoolState,
        counted: bool = True,
    ) -> list[tuple[int, BlockHash]]:
        """Blocks announced without their tokens or extra keys (pool writes, offloads): the publisher computed
        them, so its own cache announced them first, with both, under the same vLLM hashes. Entered for state
        as store would; (kvroute hash, vLLM hash) of those known, as the others are skipped."""
        blocks, holders, bit = state.blocks[tier], self.holders[tier], state.bit
        find, bump = self.find, 1 if counted else 0
        known: list[tuple[int, BlockHash]] = []
        for vllm_hash in reversed(vllm_hashes):  # tail first, as store
            key = vllm_key(vllm_hash)
            packed = blocks.pop(key, None)
            if packed is None:
                found = find(publisher, key, pool)
                if found is None:
                    self.stats.orphaned += 1
                    continue
                own_hash = found >> COUNT_BITS
                packed = (own_hash << COUNT_BITS) + 1
                holders[own_hash] = holders.get(own_hash, 0) | bit  # the pool's bit is its members' mask
                self.entries += 1
            elif packed & COUNT_MASK != COUNT_MASK:
                packed += bump
            blocks[key] = packed
            known.append((packed >> COUNT_BITS, vllm_hash))
        self.stats.stored += len(known)
        return known

    def remove(self, state: OwnerState, tier: Tier, vllm_hashes: Sequence[BlockHash]) -> None:
        blocks = state.blocks[tier]
        release = self.release
        for vllm_hash in vllm_hashes:
            key = vllm_key(vllm_hash)
            packed = blocks.get(key)
            if packed is None:
                continue
            if packed & COUNT_MASK > 1:
                blocks[key] = packed - 1
                continue
            del blocks[key]
            release(state, tier, packed >> COUNT_BITS)
            self.stats.removed += 1

    def release(self, state: OwnerState, tier: Tier, own_hash: int) -> None:
        """state no longer holds own_hash in tier (its entry is gone already)."""
        holders = self.holders[tier]
        mask = holders.get(own_hash, 0) & ~state.bit
        if mask:
            holders[own_hash] = mask
        else:
            holders.pop(own_hash, None)
        if tier is Tier.POOL:
            cast(PoolState, state).hashes.pop(own_hash, None)
        self.entries -= 1

    def clear(self, state: OwnerState, tiers: Iterable[Tier] = Tier) -> None:
        release = self.release
        for tier in tiers:
            blocks = state.blocks[tier]
            for packed in blocks.values():
                release(state, tier, packed >> COUNT_BITS)
            blocks.clear()

    def reused(self, instance: str, chain: Sequence[int], end: int) -> None:
        """A request routed to instance reuses its blocks chain[:end] there: vLLM's LRU keeps them, so the
        bound gives them a second chance. Noted only past half the bound, where eviction is near: below it
        this costs nothing."""
        if self.entries <= self.max_entries // 2 or end <= 0:
            return
        state = self.owners.get((instance, 0))
        if state is None:
            return
        if len(state.used) > state.size():  # never more notes than entries
            state.used.clear()
        state.used.update(itertools.islice(chain, end))

    def shrink(self, pools: Iterable[PoolState]) -> None:
        """Evict down to 99% of the bound, in batches from the front of the largest owner's largest map
        (one by one, each front lookup would rescan the slots of the entries popped before it); a batch is at
        most 1/16 of that owner, so owners shrink evenly; the pools' pseudo-owners are owners here. The count
        is checked against the maps first: were it above their size, this would cut too much, and past their
        size it would never end."""
        owners = [*self.owners.values(), *pools]
        size = sum(map(OwnerState.size, owners))
        if size != self.entries:
            if not self._warned_drift:
                self._warned_drift = True
                log.warning("block index: %d entries counted, %d held; count resynced", self.entries, size)
            self.entries = size
        target = self.max_entries - self.max_entries // 100
        release = self.release
        while self.entries > target:
            state = max(owners, key=OwnerState.size)
            tier = max(Tier, key=lambda t: len(state.blocks[t]))
            blocks = state.blocks[tier]
            batch = min(self.entries - target, max(1, state.size() // 16))
            used = state.used
            for key in blocks.oldest(batch):
                own_hash = (packed := blocks.pop(key)) >> COUNT_BITS
                if own_hash in used:  # reused since: a second chance, as the newest entry
                    used.discard(own_hash)
                    blocks[key] = packed
                    continue
                release(state, tier, own_hash)
                self.stats.evicted += 1
