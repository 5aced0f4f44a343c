"""The global block index: which instance holds which prompt blocks, in which tier, from their KV events.

Layout, chosen for lookup speed and memory:
- per tier, one dict from kvroute's block hash to a bitmask of the owners holding it, so matching a prompt
  costs one dict probe per block for the whole fleet, however many instances it has;
- per owner and tier, a dict from vLLM's block hash (low 64 bits) to kvroute's hash packed with a reference
  count, so BlockRemoved resolves and a block stored twice survives one removal.
An owner is (instance, data parallel rank): ranks publish separately and are cleared separately.
Entries are bounded: past max_entries, the least recently stored entries of the largest owner go first,
but one a request was routed to reuse since gets a second chance (an approximation of vLLM's LRU, which
keeps a hot shared prefix however long ago it was stored).

The pool tier is shared per pool name: blocks a Mooncake connector wrote to the distributed pool are keyed
there by their model's name (its pool name) too, so they can be loaded by every instance connected to the
pool that runs a model of the same pool name. They are kept once per pool name, in a pseudo-owner whose bit
is the mask of that pool name's members: its instances that have written to the pool (the ones shown to be
connected) or are configured to read it. An instance's pool name comes from the configuration; instances
never given one share the unnamed pool. The pool never announces eviction, so its entries are checked
against the Mooncake master, pool name by pool name, before they decide a routing choice
(router/index/pool.py).
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import logging
import operator
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple, TypeAlias, cast

from router.index.events import EVENT_TYPES, AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent
from router.index.kv_groups import CONSTRAINING_KINDS, GroupConstraints
from router.prompt import block_hashing
from scorers.request import TierMatch

log = logging.getLogger(__name__)

Owner = tuple[str, int]
"""(instance name, data parallel rank)"""

_Masks: TypeAlias = list[int] | None  # each block's holders in a tier, as owner bits; None: no one holds any

_COUNT_BITS = 16
_COUNT_MASK = (1 << _COUNT_BITS) - 1


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


# What vLLM's GPU block pool announces under: its events carry every block's extra keys (an adapter's name, a
# cache salt), so the blocks' kvroute hashes can be computed from them.
_GPU_MEDIA = frozenset({None, "GPU"})
# The event types BlockIndex.apply handles: a type registered in router/index/events.py but not here would be
# passed over in silence.
_HANDLED = (BlockStored, BlockRemoved, AllBlocksCleared)
if set(_HANDLED) != set(EVENT_TYPES):
    raise TypeError(f"BlockIndex.apply handles {_HANDLED}; router/index/events.py has {list(EVENT_TYPES)}")


class Speculation(NamedTuple):
    """The blocks one routed request entered as pending at its instance, and until when."""

    blocks: list[int]
    until: float


def _key(vllm_hash: BlockHash) -> int:
    """vLLM's hash as a key: integers as they are (as _store keys them), bytes by their low 64 bits."""
    if isinstance(vllm_hash, bytes):
        return int.from_bytes(vllm_hash[-8:], "big")
    return vllm_hash


@dataclass
class _OwnerState:
    bit: int
    # per tier: vLLM key -> kvroute hash << 16 | refcount
    blocks: tuple[dict[int, int], ...] = field(default_factory=lambda: tuple({} for _ in Tier))
    used: set[int] = field(default_factory=set)  # kvroute hashes routed here for reuse since the bound passed

    def size(self) -> int:
        return sum(len(b) for b in self.blocks)


@dataclass
class _PoolState(_OwnerState):
    """One pool name's share of the pool: its bit is the mask of its members."""

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


class BlockIndex:
    def __init__(
        self,
        block_size: int,
        max_entries: int = 10_000_000,
        speculative_ttl_s: float = 2.0,
        medium_tiers: Mapping[str | None, Tier] = DEFAULT_MEDIUM_TIERS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.block_size = block_size
        self.max_entries = max_entries
        self.stats = IndexStats()
        self._ttl = speculative_ttl_s
        self._medium_tiers = medium_tiers
        # Where the GPU's blocks are kept: announced as "GPU" or with no medium (older vLLM).
        self._gpu_tiers = {medium_tiers[m] for m in (None, "GPU") if m in medium_tiers} or {Tier.GPU}
        # Where vLLM's offloading connectors' blocks are kept (an owner holds no pool entries of its own).
        self._offload_tiers = {self._tier(m) for m in ("CPU", "STORAGE")} - {Tier.POOL}
        self._clock = clock
        self._holders: tuple[dict[int, int], ...] = tuple({} for _ in Tier)
        self._owners: dict[Owner, _OwnerState] = {}
        self._owner_by_bit: dict[int, Owner] = {}
        self._free_bits: list[int] = []  # of owners forgotten, for the next ones
        self._entries = 0
        self._pending: dict[int, int] = {}  # speculative: kvroute hash -> owner mask
        # owner bit -> hash -> latest deadline, for blocks speculated again while pending (the rest expire
        # with their request's record); small, so the common case touches one big map, not two
        self._respeculated: dict[int, dict[int, float]] = {}
        # one record per speculate call, (deadline, bit, hashes), oldest first
        self._pending_expiry: deque[tuple[float, int, list[int]]] = deque()
        # The pool's pseudo-owners, one per pool name: each one's bit is the mask of its members (see
        # _join_pool), so its entries count for all of them; entries are not refcounted, a pooled object is
        # one object. An instance is in one pool name's mask at most, so the masks never overlap.
        self._unnamed = _PoolState(bit=0)
        self._pools: dict[str, _PoolState] = {"": self._unnamed}
        self._pool_of: dict[str, _PoolState] = {}  # instance -> its pool name's pseudo-owner, when named
        self._warned_unkeyed = False
        self._warned_drift = False
        # A hybrid model's sliding-window and Mamba groups, which cut what its full-attention blocks match.
        self._groups = GroupConstraints(block_size, max_entries)

    # ---- events -------------------------------------------------------------------------------------

    def apply(self, owner: Owner, events: Sequence[KVEvent]) -> None:
        state = self._owner(owner)
        pool = self._pool_of.get(owner[0], self._unnamed)
        # vLLM's scheduler publishes its GPU block pool's events, then its connector's: an event of another
        # medium means the rest of the batch is the connector's.
        past_gpu = False
        # Constraining groups' events, applied once the batch's full-attention blocks are in: a group's block
        # takes the kvroute hash of the full-attention block at its position, which may come later.
        grouped: list[BlockStored | BlockRemoved] = []
        hybrid: bool | None = None  # learnt once a batch, when a constraining group's store comes
        for event in events:
            if not isinstance(event, AllBlocksCleared) and event.medium not in _GPU_MEDIA:
                past_gpu = True
            if isinstance(event, BlockStored):
                if not event.block_hashes:
                    continue
                kind = event.kv_cache_spec_kind
                if kind in CONSTRAINING_KINDS and event.medium in _GPU_MEDIA:
                    hybrid = self._hybrid(state, events) if hybrid is None else hybrid
                    if hybrid and event.block_size != self.block_size:  # not to be set beside the index's
                        self.stats.mismatched += 1
                        continue
                    if hybrid:
                        window = event.kv_cache_spec_sliding_window
                        self._groups.declare(state.bit, event.group_idx, kind, window)
                        grouped.append(event)
                        continue
                tier = self._tier(event.medium)
                if tier is Tier.POOL:
                    self._store_pooled(state, pool, event)
                elif not event.token_ids:  # the OffloadingConnector's default announcement: a key alone
                    self._store_known(state, state, tier, event, pool)
                elif event.medium in _GPU_MEDIA or event.extra_keys is not None:
                    self._store(state, tier, event, pool)
                elif self._shaped(event):
                    # An offload announced without its request's extra keys (vLLM 0.32's OffloadingConnector
                    # defers them): hashed from its tokens, a salted prompt's or an adapter's block would be
                    # another prompt's. Its vLLM hashes are its GPU copies', announced with the keys first.
                    self._store_known(state, state, tier, event, pool)
            elif isinstance(event, BlockRemoved):
                if event.medium in _GPU_MEDIA and self._groups.is_group(state.bit, event.group_idx):
                    grouped.append(event)
                    continue
                tier = self._tier(event.medium)
                self._remove(pool if tier is Tier.POOL else state, tier, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                # It names no medium (vLLM 0.32). The GPU block pool's reset sends one, and so does that of a
                # SimpleCPUOffloadConnector's CPU block pool, which the same reset call makes after the GPU's:
                # a clear after the batch's first, or after an event of another medium, is the connector's.
                # (The OffloadingConnector's and the Mooncake store's resets send none.)
                if not past_gpu:  # the GPU block pool's: every group's blocks go, those of the batch too
                    grouped = []
                    self._groups.clear(state.bit)
                self._clear(state, self._offload_tiers if past_gpu else self._gpu_tiers)
                past_gpu = True
        if grouped:
            self._apply_grouped(state, grouped)
        if self._entries > self.max_entries:
            self._shrink()

    def _hybrid(self, state: _OwnerState, events: Sequence[KVEvent]) -> bool:
        """Whether the owner has a full-attention group beside its constraining ones, learnt from its first
        batch that shows one: a model whose only group is a sliding window (or Mamba) has nothing to cut, and
        its blocks are the index's own."""
        if self._groups.anchored(state.bit):
            return True
        if any(
            isinstance(e, BlockStored)
            and e.kv_cache_spec_kind not in CONSTRAINING_KINDS
            and e.kv_cache_spec_kind is not None
            and e.medium in _GPU_MEDIA
            for e in events
        ):
            self._groups.anchor(state.bit)
            return True
        return False

    def _apply_grouped(self, state: _OwnerState, events: Sequence[BlockStored | BlockRemoved]) -> None:
        """Constraining groups' stores and removals, in order. A stored block is indexed under the kvroute
        hash of the owner's full-attention block of the same vLLM hash; one it does not hold is an orphan."""
        gpu_blocks = [state.blocks[tier] for tier in self._gpu_tiers]
        for event in events:
            keys = [_key(h) for h in event.block_hashes]
            if isinstance(event, BlockRemoved):
                self._groups.remove(state.bit, event.group_idx, keys)
                continue
            known = []
            for key in keys:
                packed = next((p for blocks in gpu_blocks if (p := blocks.get(key)) is not None), None)
                if packed is None:
                    self.stats.orphaned += 1
                else:
                    known.append((key, packed >> _COUNT_BITS))
            self._groups.store(state.bit, event.group_idx, known)

    def drop_instance(self, instance: str) -> None:
        """Forget everything every rank of instance holds (it restarted)."""
        for owner in [o for o in self._owners if o[0] == instance]:
            self.drop(owner)

    def forget_instance(self, instance: str) -> None:
        """instance left the fleet: its entries, its pool membership and its owner bits go, and the bits are
        given to instances added later. Kept, they would grow every mask by a bit per name ever seen (a fleet
        whose pod names change at each rollout)."""
        self.drop_instance(instance)
        self.leave_pool(instance)
        gone = 0
        for owner in [o for o in self._owners if o[0] == instance]:
            bit = self._owners.pop(owner).bit
            del self._owner_by_bit[bit]
            self._groups.forget(bit)
            self._respeculated.pop(bit, None)
            self._free_bits.append(bit)
            gone |= bit
        if not gone:
            return
        keep = ~gone
        self._pending = {block: kept for block, mask in self._pending.items() if (kept := mask & keep)}
        self._pending_expiry = deque(record for record in self._pending_expiry if not record[1] & gone)

    def drop(self, owner: Owner) -> None:
        """Forget everything an owner holds (engine restart, lost events)."""
        state = self._owners.get(owner)
        if state is not None:
            self._clear(state)
            self._groups.clear(state.bit)

    def _store(
        self, state: _OwnerState, tier: Tier, event: BlockStored, pool: _PoolState, counted: bool = True
    ) -> list[int]:
        """Index the event's blocks for state, whose parent may be in pool; their kvroute hashes, or [] when
        they cannot be indexed. counted=False keeps a block stored twice at one reference."""
        if not self._shaped(event):
            return []
        if max(event.token_ids) >= 1 << 32:  # kvroute hashes token ids as uint32
            self.stats.mismatched += 1
            return []
        size, blocks = self.block_size, state.blocks[tier]
        if event.parent_block_hash is None:
            parent = block_hashing.root_for(event.lora_name)
        else:
            packed = self._find(state, _key(event.parent_block_hash), pool)
            if packed is None:
                self.stats.orphaned += len(event.block_hashes)
                return []
            parent = packed >> _COUNT_BITS
        try:
            own = block_hashing.chain(event.token_ids, size, parent, event.extra_keys)
        except OverflowError:  # a negative token id: no uint32
            self.stats.mismatched += 1
            return []
        hashes = event.block_hashes
        # Integer hashes are vLLM's 64 bits already; only bytes hashes need converting.
        keys = cast(list[int], hashes) if type(hashes[0]) is int else [_key(h) for h in hashes]
        holders, bit = self._holders[tier], state.bit
        # Blocks no one holds, under keys the owner does not use: the common case, bulk inserted in C, tail
        # first (see below). A key in use with other content (an inconsistent publisher, a 64-bit collision)
        # must take the per-block path: overwritten, it would be counted twice and its old hash kept.
        if holders.keys().isdisjoint(own) and blocks.keys().isdisjoint(keys):
            holders.update(zip(reversed(own), itertools.repeat(bit)))
            blocks.update(zip(reversed(keys), [(h << _COUNT_BITS) + 1 for h in reversed(own)], strict=True))
            self._entries += len(own)
            self.stats.stored += len(own)
            return own
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
                blocks[key] = (own_hash << _COUNT_BITS) + 1
            else:
                blocks[key] = packed + bump if packed & _COUNT_MASK != _COUNT_MASK else packed
        self._entries += added
        self.stats.stored += len(own)
        return own

    def _shaped(self, event: BlockStored) -> bool:
        """Whether the event's blocks are the index's: of its block size, with their tokens (and extra keys,
        when sent) one block's worth each. Counted as mismatched when not."""
        count, size, extra = len(event.block_hashes), self.block_size, event.extra_keys
        if (
            event.block_size == size
            and len(event.token_ids) == count * size
            and (extra is None or len(extra) == count)
        ):
            return True
        self.stats.mismatched += 1
        return False

    def _store_pooled(self, publisher: _OwnerState, pool: _PoolState, event: BlockStored) -> None:
        hashes = event.block_hashes
        if type(hashes[0]) is not bytes:
            self.stats.unkeyed += len(hashes)
            if not self._warned_unkeyed:
                self._warned_unkeyed = True
                log.warning(
                    "pool blocks announced with integer hashes are ignored: their Mooncake keys need "
                    "vLLM's full hashes (run vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)"
                )
            return
        self._join_pool(publisher, pool)
        for unchanged in pool.asked:  # stored again: a lookup begun before this speaks for the old copy only
            unchanged.difference_update(hashes)
        # vLLM's store worker announces pool writes without the request's extra keys (a LoRA adapter's name, a
        # cache salt): hashed from their tokens they would be the base model's plain blocks. The writer's own
        # cache announced them first, with those keys, so its kvroute hashes are taken when it knows them all.
        if event.token_ids and not all(self._find(publisher, _key(h), pool) is not None for h in hashes):
            own = self._store(pool, Tier.POOL, event, pool, counted=False)  # all of the blocks or none
            pool.hashes.update(zip(own, cast(list[bytes], hashes), strict=False))
        else:
            known = self._store_known(publisher, pool, Tier.POOL, event, pool, counted=False)
            pool.hashes.update(cast(list[tuple[int, bytes]], known))

    def _store_known(
        self,
        publisher: _OwnerState,
        state: _OwnerState,
        tier: Tier,
        event: BlockStored,
        pool: _PoolState,
        counted: bool = True,
    ) -> list[tuple[int, BlockHash]]:
        """Blocks announced without their tokens or extra keys (pool writes, offloads): the publisher computed
        them, so its own cache announced them first, with both, under the same vLLM hashes. Indexed for state
        as _store would; (kvroute hash, vLLM hash) of those known, as the others are skipped."""
        blocks, holders, bit = state.blocks[tier], self._holders[tier], state.bit
        bump = 1 if counted else 0
        known: list[tuple[int, BlockHash]] = []
        for vllm_hash in reversed(event.block_hashes):  # tail first, as _store
            key = _key(vllm_hash)
            packed = blocks.pop(key, None)
            if packed is None:
                found = self._find(publisher, key, pool)
                if found is None:
                    self.stats.orphaned += 1
                    continue
                own_hash = found >> _COUNT_BITS
                packed = (own_hash << _COUNT_BITS) + 1
                holders[own_hash] = holders.get(own_hash, 0) | bit  # the pool's bit is its members' mask
                self._entries += 1
            elif packed & _COUNT_MASK != _COUNT_MASK:
                packed += bump
            blocks[key] = packed
            known.append((packed >> _COUNT_BITS, vllm_hash))
        self.stats.stored += len(known)
        return known

    def set_pool_name(self, instance: str, pool_name: str) -> None:
        """instance's model is named pool_name in Mooncake keys: the pool blocks it writes are pool_name's,
        and of the pool's blocks only pool_name's count for it."""
        pool = self._pool(pool_name)
        old = self._pool_of.get(instance, self._unnamed)
        if pool is old:
            return
        self._pool_of[instance] = pool
        moving = old.bit & self._bits_of(instance)
        if moving:
            self._set_members(old, old.bit & ~moving)
            self._set_members(pool, pool.bit | moving)

    def join_pool(self, instance: str) -> None:
        """Count its pool name's entries for instance before it has written to the pool (it is configured to
        read it)."""
        self._join_pool(self._owner((instance, 0)), self._pool_of.get(instance, self._unnamed))

    def leave_pool(self, instance: str) -> None:
        """instance left the fleet: pool entries no longer count for it, and its pool name is forgotten."""
        pool, bits = self._pool_of.pop(instance, self._unnamed), self._bits_of(instance)
        if pool.bit & bits:
            self._set_members(pool, pool.bit & ~bits)

    def _join_pool(self, member: _OwnerState, pool: _PoolState) -> None:
        """An instance that writes to the pool is connected to it: its pool name's entries count for it."""
        if not pool.bit & member.bit:
            self._set_members(pool, pool.bit | member.bit)

    def _set_members(self, pool: _PoolState, members: int) -> None:
        """pool's entries count for members from now on; other pool names' bits in holders stay."""
        holders, old = self._holders[Tier.POOL], pool.bit
        pool.bit = members
        for packed in pool.blocks[Tier.POOL].values():
            own_hash = packed >> _COUNT_BITS
            mask = (holders.get(own_hash, 0) & ~old) | members
            if mask:
                holders[own_hash] = mask
            else:
                holders.pop(own_hash, None)

    def _pool(self, pool_name: str) -> _PoolState:
        pool = self._pools.get(pool_name)
        if pool is None:
            pool = self._pools[pool_name] = _PoolState(bit=0, name=pool_name)
        return pool

    def _bits_of(self, instance: str) -> int:
        """The bits of every rank of instance."""
        return sum(state.bit for (name, _), state in self._owners.items() if name == instance)

    def _remove(self, state: _OwnerState, tier: Tier, vllm_hashes: Sequence[BlockHash]) -> None:
        blocks = state.blocks[tier]
        for vllm_hash in vllm_hashes:
            key = _key(vllm_hash)
            packed = blocks.get(key)
            if packed is None:
                continue
            if packed & _COUNT_MASK > 1:
                blocks[key] = packed - 1
                continue
            del blocks[key]
            self._release(state, tier, packed >> _COUNT_BITS)
            self.stats.removed += 1

    def _release(self, state: _OwnerState, tier: Tier, own_hash: int) -> None:
        holders = self._holders[tier]
        mask = holders.get(own_hash, 0) & ~state.bit
        if mask:
            holders[own_hash] = mask
        else:
            holders.pop(own_hash, None)
        if tier is Tier.POOL:
            cast(_PoolState, state).hashes.pop(own_hash, None)
        self._entries -= 1

    def _clear(self, state: _OwnerState, tiers: Iterable[Tier] = Tier) -> None:
        for tier in tiers:
            blocks = state.blocks[tier]
            for packed in blocks.values():
                self._release(state, tier, packed >> _COUNT_BITS)
            blocks.clear()

    def _shrink(self) -> None:
        """Evict down to 99% of the bound, in batches from the front of the largest owner's largest map
        (one by one, each front lookup would rescan the slots of the entries popped before it); a batch is at
        most 1/16 of that owner, so owners shrink evenly. The count is checked against the maps first: were
        it above their size, this would cut too much, and past their size it would never end."""
        owners = [*self._owners.values(), *self._pools.values()]
        size = sum(map(_OwnerState.size, owners))
        if size != self._entries:
            if not self._warned_drift:
                self._warned_drift = True
                log.warning("block index: %d entries counted, %d held; count resynced", self._entries, size)
            self._entries = size
        target = self.max_entries - self.max_entries // 100
        while self._entries > target:
            state = max(owners, key=_OwnerState.size)
            tier = max(Tier, key=lambda t: len(state.blocks[t]))
            blocks = state.blocks[tier]
            batch = min(self._entries - target, max(1, state.size() // 16))
            used = state.used
            for key in list(itertools.islice(blocks, batch)):
                own_hash = (packed := blocks.pop(key)) >> _COUNT_BITS
                if own_hash in used:  # reused since: a second chance, as the newest entry
                    used.discard(own_hash)
                    blocks[key] = packed
                    continue
                self._release(state, tier, own_hash)
                self.stats.evicted += 1

    def _find(self, state: _OwnerState, key: int, pool: _PoolState) -> int | None:
        """A block's packed entry by vLLM key, in any tier of state or in pool: a parent may be either."""
        for blocks in (*state.blocks, pool.blocks[Tier.POOL]):
            packed = blocks.get(key)
            if packed is not None:
                return packed
        return None

    def _tier(self, medium: str | None) -> Tier:
        return self._medium_tiers.get(medium, Tier.CPU)

    def _owner(self, owner: Owner) -> _OwnerState:
        state = self._owners.get(owner)
        if state is None:
            # Bits in use and free ones are always the lowest len(owners) + len(free) bits.
            bit = self._free_bits.pop() if self._free_bits else 1 << len(self._owners)
            state = self._owners[owner] = _OwnerState(bit)
            self._owner_by_bit[bit] = owner
        return state

    # ---- routing ------------------------------------------------------------------------------------

    def match(
        self, chain: Sequence[int], include_pool: bool = True, reusable: int | None = None
    ) -> dict[str, TierMatch]:
        """For every instance holding a prefix of chain: its contiguous matched blocks, by best tier.

        Speculative entries count as GPU blocks. Of one instance's ranks, the best match counts.
        Pool blocks count for every member of their pool name, unless include_pool is False. reusable: the
        blocks the engine may reuse (all but the last prompt token's), within which a hybrid model's other
        KV cache groups decide its hit as vLLM does; None: all of chain.
        """
        gpu, cpu, pool = self._probe(chain, include_pool)
        return self._matched(chain, gpu, cpu, _either(_either(gpu, cpu), pool), reusable, {})

    def match_with_own(
        self, chain: Sequence[int], reusable: int | None = None
    ) -> tuple[dict[str, TierMatch], dict[str, TierMatch]]:
        """match(chain) and match(chain, include_pool=False) from one probe of the tiers: the instances' own
        prefixes are where the pool credit to confirm begins (router/index/pool.py)."""
        gpu, cpu, pool = self._probe(chain)
        held = _either(gpu, cpu)
        cuts: dict[tuple[int, int], int] = {}
        own = self._matched(chain, gpu, cpu, held, reusable, cuts)
        if pool is None:
            return own, own
        return self._matched(chain, gpu, cpu, _either(held, pool), reusable, cuts), own

    def _probe(self, chain: Sequence[int], include_pool: bool = True) -> tuple[_Masks, _Masks, _Masks]:
        """Each block's holders in the GPU (speculative entries too), CPU and pool tiers; None for a tier no
        one holds anything in, and for every tier when chain is empty."""
        self._expire()
        if not chain:
            return None, None, None
        gpu = self._held(chain, self._holders[Tier.GPU], self._pending)
        cpu = self._held(chain, self._holders[Tier.CPU])
        return gpu, cpu, self._held(chain, self._holders[Tier.POOL]) if include_pool else None

    def _matched(
        self,
        chain: Sequence[int],
        gpu: _Masks,
        cpu: _Masks,
        held: _Masks,
        reusable: int | None,
        cuts: dict[tuple[int, int], int],
    ) -> dict[str, TierMatch]:
        """The matches of held, each block's holders over the tiers counted. All in C: the running AND of held
        (owners holding every block so far) never grows, so where an owner's bit leaves it is a bisection.
        A hybrid model's owner's match is then cut to what its other KV cache groups allow (cuts: those
        found already, by owner and match length)."""
        if held is None:
            return {}
        alive = list(itertools.accumulate(held, operator.and_))
        ends = {bit: _match_length(alive, bit) for bit in _bits(alive[0])}
        if self._groups:
            groups, limit = self._groups, len(chain) if reusable is None else reusable
            for bit, end in ends.items():
                if groups.constrains(bit):
                    if (found := cuts.get((bit, end))) is None:
                        found = cuts[bit, end] = groups.cut(bit, chain, min(end, limit), self._pending)
                    ends[bit] = found
            ends = {bit: end for bit, end in ends.items() if end}
        return self._attribute(ends, gpu, cpu, only_gpu=held is gpu)

    @staticmethod
    def _held(chain: Sequence[int], *maps: dict[int, int]) -> list[int] | None:
        """Each block's holder mask over maps; None when they are all empty."""
        present = [mapping for mapping in maps if mapping]
        if not present:
            return None
        zeros = itertools.repeat(0)
        held = list(map(present[0].get, chain, zeros))
        for mapping in present[1:]:
            held = list(map(operator.or_, held, map(mapping.get, chain, zeros)))
        return held

    def _attribute(
        self, ends: dict[int, int], gpu: list[int] | None, cpu: list[int] | None, only_gpu: bool
    ) -> dict[str, TierMatch]:
        """Credit each matched block to the best tier its owner holds it in (GPU, then CPU, then pool)."""
        if cpu is not None and gpu is not None:
            cpu = list(map(operator.and_, cpu, map(operator.invert, gpu)))  # CPU copies not also on GPU
        matches: dict[str, TierMatch] = {}
        for bit, end in ends.items():
            if only_gpu:
                found = TierMatch(gpu=end)
            else:
                on_gpu = _count_with(gpu, bit, end)
                on_cpu = _count_with(cpu, bit, end)
                found = TierMatch(on_gpu, on_cpu, end - on_gpu - on_cpu)
            name = self._owner_by_bit[bit][0]
            known = matches.get(name)
            if known is None or _total(found) > _total(known):
                matches[name] = found
        return matches

    def pooled(
        self, chain: Sequence[int], start: int, end: int, pool_name: str = ""
    ) -> list[tuple[int, bytes]]:
        """(position, vLLM's full hash) of pool_name's pool blocks among chain[start:end]."""
        pool = self._pools.get(pool_name)
        if pool is None:
            return []
        full = pool.hashes.get
        found = []
        for position in range(start, min(end, len(chain))):
            vllm_hash = full(chain[position])
            if vllm_hash is not None:
                found.append((position, vllm_hash))
        return found

    def forget_pooled(self, vllm_hashes: Sequence[bytes], pool_name: str = "") -> None:
        """Drop pool_name's entries the pool no longer holds (evicted, or lost with a client's segment)."""
        pool = self._pools.get(pool_name)
        if pool is not None:
            self._remove(pool, Tier.POOL, vllm_hashes)

    @contextlib.contextmanager
    def asking(self, vllm_hashes: Iterable[bytes], pool_name: str = "") -> Iterator[set[bytes]]:
        """For a lookup of vllm_hashes on the master: the set of those not stored in pool_name's pool again
        while the block runs. The master's "missing" for one stored again predates the new copy."""
        asked, unchanged = self._pool(pool_name).asked, set(vllm_hashes)
        asked.append(unchanged)
        try:
            yield unchanged
        finally:
            asked[:] = [other for other in asked if other is not unchanged]  # equal sets are other lookups'

    def reused(self, instance: str, chain: Sequence[int], end: int) -> None:
        """A request routed to instance reuses its blocks chain[:end] there: vLLM's LRU keeps them, so the
        bound gives them a second chance. Noted only past half the bound, where eviction is near: below it
        this costs nothing."""
        if self._entries <= self.max_entries // 2 or end <= 0:
            return
        state = self._owners.get((instance, 0))
        if state is None:
            return
        if len(state.used) > state.size():  # never more notes than entries
            state.used.clear()
        state.used.update(itertools.islice(chain, end))

    def speculate(self, instance: str, chain: Sequence[int], start: int = 0) -> Speculation:
        """Enter a routed request's blocks (from chain[start]) for its instance until their events arrive;
        returns what was entered, for withdraw.

        A long prompt enters thousands of blocks: one expiry record per request, and a deadline of its own
        only for a block this instance already had pending.
        """
        bit = self._owner((instance, 0)).bit
        deadline = self._clock() + self._ttl
        blocks = list(itertools.islice(chain, start, None))
        pending, later = self._pending, self._respeculated.setdefault(bit, {})
        for block in blocks:
            mask = pending.get(block, 0)
            if mask & bit or (later and block in later):  # pending, or withdrawn while its record lives
                later[block] = deadline
            if not mask & bit:
                pending[block] = mask | bit
        self._pending_expiry.append((deadline, bit, blocks))
        return Speculation(blocks, deadline)

    def withdraw(self, instance: str, speculation: Speculation) -> None:
        """A routed request that never ran there (refused, or the instance failed it): its speculative
        blocks go now rather than at their deadline. Another request's speculation of the same blocks on the
        same instance goes too; the events of what that one computes enter them for real."""
        state = self._owners.get((instance, 0))
        now = self._clock()
        if state is None or now >= speculation.until:  # expired already: what is pending is others'
            return
        bit, pending = state.bit, self._pending
        later, keep = self._respeculated.setdefault(bit, {}), ~state.bit
        for block in speculation.blocks:
            # Its expiry record stays: a deadline already passed tells that record to let a later
            # speculation of the block stand, and goes with it.
            later[block] = now
            mask = pending.get(block, 0) & keep
            if mask:
                pending[block] = mask
            else:
                pending.pop(block, None)

    def _expire(self) -> None:
        now, expiry, pending = self._clock(), self._pending_expiry, self._pending
        while expiry and expiry[0][0] <= now:
            _, bit, blocks = expiry.popleft()
            later, keep = self._respeculated[bit], ~bit
            for block in blocks:
                if later:
                    until = later.get(block)
                    if until is not None:
                        if until > now:  # speculated again since: the later deadline holds
                            continue
                        del later[block]
                mask = pending.get(block, 0) & keep
                if mask:
                    pending[block] = mask
                else:
                    pending.pop(block, None)

    # ---- observation --------------------------------------------------------------------------------

    @property
    def entries(self) -> int:
        return self._entries

    def entries_by_owner(self) -> dict[Owner, tuple[int, ...]]:
        """Entries per instance and rank, by tier; the shared pool's are in pool_entries."""
        return {owner: tuple(len(b) for b in state.blocks) for owner, state in self._owners.items()}

    @property
    def pool_entries(self) -> int:
        return sum(len(pool.blocks[Tier.POOL]) for pool in self._pools.values())

    def pool_members(self) -> list[str]:
        """Instances that read the pool: configured to, or shown to by writing to it."""
        members = 0
        for pool in self._pools.values():
            members |= pool.bit
        return sorted({name for bit, (name, _) in self._owner_by_bit.items() if bit & members})

    def pool_name(self, instance: str) -> str:
        """The pool name whose pool entries count for instance ("" when it was never given one)."""
        return self._pool_of.get(instance, self._unnamed).name

    def footprint_bytes(self, sample: int = 256) -> int:
        """Memory held by the index: exact dict tables, key and value objects sized from a sample of each."""
        owners = [*self._owners.values(), *self._pools.values()]
        maps: list[Mapping[int, int | bytes]] = [
            *self._holders,
            self._pending,
            *(b for s in owners for b in s.blocks),
            *(pool.hashes for pool in self._pools.values()),
        ]
        total = 0
        for mapping in maps:
            total += sys.getsizeof(mapping)
            if mapping:
                items = list(itertools.islice(mapping.items(), sample))
                per_item = sum(_object_bytes(k) + _object_bytes(v) for k, v in items) / len(items)
                total += int(per_item * len(mapping))
        return total


def _either(first: list[int] | None, second: list[int] | None) -> list[int] | None:
    """Each block's holders in either of two tiers' masks (None: a tier no one holds anything in)."""
    if first is None or second is None:
        return second if first is None else first
    return list(map(operator.or_, first, second))


def _object_bytes(value: int | bytes) -> int:
    """CPython shares the ints -5..256: an owner mask of 1, 2 or 4 costs its dict slot only."""
    return 0 if isinstance(value, int) and -5 <= value <= 256 else sys.getsizeof(value)


def _match_length(alive: list[int], bit: int) -> int:
    """Blocks before bit leaves the running AND; the masks never gain bits, so this is a bisection."""
    return bisect.bisect_left(alive, True, key=lambda mask: not mask & bit)


def _count_with(masks: list[int] | None, bit: int, end: int) -> int:
    """How many of the first end masks have bit set, counted in C."""
    if masks is None:
        return 0
    return end - list(map(operator.and_, itertools.islice(masks, end), itertools.repeat(bit))).count(0)


def _bits(mask: int) -> list[int]:
    found = []
    while mask:
        low = mask & -mask
        found.append(low)
        mask ^= low
    return found


def _total(match: TierMatch) -> int:
    return match.gpu + match.cpu + match.pool
