"""KV events into the block index's tables: a batch of one owner's stores, removals and clears, in order.

Blocks are indexed under kvroute's hashes, computed from their tokens and extra keys along their parent's
chain; announcements without them (offloads, pool writes) take the hashes of the publisher's own copies under
the same vLLM hashes. A hybrid model's sliding-window and Mamba groups' blocks go to
router/index/kv_groups.py.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from typing import cast

from router.index.events import EVENT_TYPES, AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent
from router.index.holdings import COUNT_BITS, COUNT_MASK, Holdings, OwnerState, PoolState, Tier, vllm_key
from router.index.kv_groups import CONSTRAINING_KINDS, GroupConstraints
from router.index.pool_tier import PoolTier
from router.prompt import block_hashing

log = logging.getLogger(__name__)

# What vLLM's GPU block pool announces under: its events carry every block's extra keys (an adapter's name, a
# cache salt), so the blocks' kvroute hashes can be computed from them.
_GPU_MEDIA = frozenset({None, "GPU"})
# The event types Ingest.apply handles: a type registered in router/index/events.py but not here would be
# passed over in silence.
_HANDLED = (BlockStored, BlockRemoved, AllBlocksCleared)
if set(_HANDLED) != set(EVENT_TYPES):
    raise TypeError(f"BlockIndex.apply handles {_HANDLED}; router/index/events.py has {list(EVENT_TYPES)}")


class Ingest:
    def __init__(
        self,
        block_size: int,
        medium_tiers: Mapping[str | None, Tier],
        holdings: Holdings,
        pools: PoolTier,
        groups: GroupConstraints,
    ) -> None:
        self.block_size = block_size
        self._medium_tiers = medium_tiers
        # Where the GPU's blocks are kept: announced as "GPU" or with no medium (older vLLM).
        self._gpu_tiers = {medium_tiers[m] for m in (None, "GPU") if m in medium_tiers} or {Tier.GPU}
        # Where vLLM's offloading connectors' blocks are kept (an owner holds no pool entries of its own).
        self._offload_tiers = {self._tier(m) for m in ("CPU", "STORAGE")} - {Tier.POOL}
        self._holdings, self._pools, self._groups = holdings, pools, groups
        self.stats = holdings.stats
        self._warned_unkeyed = False

    def apply(self, state: OwnerState, pool: PoolState, events: Sequence[KVEvent]) -> None:
        """One batch of state's events; pool: its pool name's pseudo-owner."""
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
                self._holdings.remove(pool if tier is Tier.POOL else state, tier, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                # It names no medium (vLLM 0.32). The GPU block pool's reset sends one, and so does that of a
                # SimpleCPUOffloadConnector's CPU block pool, which the same reset call makes after the GPU's:
                # a clear after the batch's first, or after an event of another medium, is the connector's.
                # (The OffloadingConnector's and the Mooncake store's resets send none.)
                if not past_gpu:  # the GPU block pool's: every group's blocks go, those of the batch too
                    grouped = []
                    self._groups.clear(state.bit)
                self._holdings.clear(state, self._offload_tiers if past_gpu else self._gpu_tiers)
                past_gpu = True
        if grouped:
            self._apply_grouped(state, grouped)
        if self._holdings.entries > self._holdings.max_entries:
            self._holdings.shrink(self._pools.states())

    def _tier(self, medium: str | None) -> Tier:
        return self._medium_tiers.get(medium, Tier.CPU)

    # ---- hybrid models' other groups ----------------------------------------------------------------

    def _hybrid(self, state: OwnerState, events: Sequence[KVEvent]) -> bool:
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

    def _apply_grouped(self, state: OwnerState, events: Sequence[BlockStored | BlockRemoved]) -> None:
        """Constraining groups' stores and removals, in order. A stored block is indexed under the kvroute
        hash of the owner's full-attention block of the same vLLM hash; one it does not hold is an orphan."""
        gpu_blocks = [state.blocks[tier] for tier in self._gpu_tiers]
        for event in events:
            keys = [vllm_key(h) for h in event.block_hashes]
            if isinstance(event, BlockRemoved):
                self._groups.remove(state.bit, event.group_idx, keys)
                continue
            known = []
            for key in keys:
                packed = next((p for blocks in gpu_blocks if (p := blocks.get(key)) is not None), None)
                if packed is None:
                    self.stats.orphaned += 1
                else:
                    known.append((key, packed >> COUNT_BITS))
            self._groups.store(state.bit, event.group_idx, known)

    # ---- stores -------------------------------------------------------------------------------------

    def _store(
        self, state: OwnerState, tier: Tier, event: BlockStored, pool: PoolState, counted: bool = True
    ) -> list[int]:
        """Index the event's blocks for state, whose parent may be in pool; their kvroute hashes, or [] when
        they cannot be indexed. counted=False keeps a block stored twice at one reference."""
        own = self._hashes(state, event, pool)
        if not own:
            return own
        hashes = event.block_hashes
        # Integer hashes are vLLM's 64 bits already; only bytes hashes need converting.
        keys = cast(list[int], hashes) if type(hashes[0]) is int else [vllm_key(h) for h in hashes]
        holdings, blocks = self._holdings, state.blocks[tier]
        holders, bit = holdings.holders[tier], state.bit
        # Blocks no one holds, under keys the owner does not use: the common case, bulk inserted in C, tail
        # first (see below). A key in use with other content (an inconsistent publisher, a 64-bit collision)
        # must take the per-block path: overwritten, it would be counted twice and its old hash kept.
        if holders.keys().isdisjoint(own) and blocks.keys().isdisjoint(keys):
            holders.update(zip(reversed(own), itertools.repeat(bit)))
            blocks.update(zip(reversed(keys), [(h << COUNT_BITS) + 1 for h in reversed(own)], strict=True))
            holdings.entries += len(own)
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
                blocks[key] = (own_hash << COUNT_BITS) + 1
            else:
                blocks[key] = packed + bump if packed & COUNT_MASK != COUNT_MASK else packed
        holdings.entries += added
        self.stats.stored += len(own)
        return own

    def _hashes(self, state: OwnerState, event: BlockStored, pool: PoolState) -> list[int]:
        """The kvroute hashes of the event's blocks, from their tokens along their parent's chain (in state or
        in pool); [] when they cannot be computed, counted as mismatched or orphaned."""
        if not self._shaped(event):
            return []
        if max(event.token_ids) >= 1 << 32:  # kvroute hashes token ids as uint32
            self.stats.mismatched += 1
            return []
        if event.parent_block_hash is None:
            parent = block_hashing.root_for(event.lora_name)
        else:
            packed = self._holdings.find(state, vllm_key(event.parent_block_hash), pool)
            if packed is None:
                self.stats.orphaned += len(event.block_hashes)
                return []
            parent = packed >> COUNT_BITS
        try:
            return block_hashing.chain(event.token_ids, self.block_size, parent, event.extra_keys)
        except OverflowError:  # a negative token id: no uint32
            self.stats.mismatched += 1
            return []

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

    def _store_pooled(self, publisher: OwnerState, pool: PoolState, event: BlockStored) -> None:
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
        self._pools.join(publisher, pool)
        for unchanged in pool.asked:  # stored again: a lookup begun before this speaks for the old copy only
            unchanged.difference_update(hashes)
        # vLLM's store worker announces pool writes without the request's extra keys (a LoRA adapter's name, a
        # cache salt): hashed from their tokens they would be the base model's plain blocks. The writer's own
        # cache announced them first, with those keys, so its kvroute hashes are taken when it knows them all.
        find = self._holdings.find
        if event.token_ids and not all(find(publisher, vllm_key(h), pool) is not None for h in hashes):
            own = self._store(pool, Tier.POOL, event, pool, counted=False)  # all of the blocks or none
            pool.hashes.update(zip(own, cast(list[bytes], hashes), strict=False))
        else:
            known = self._store_known(publisher, pool, Tier.POOL, event, pool, counted=False)
            pool.hashes.update(cast(list[tuple[int, bytes]], known))

    def _store_known(
        self,
        publisher: OwnerState,
        state: OwnerState,
        tier: Tier,
        event: BlockStored,
        pool: PoolState,
        counted: bool = True,
    ) -> list[tuple[int, BlockHash]]:
        """Blocks announced without their tokens or extra keys (pool writes, offloads): the publisher computed
        them, so its own cache announced them first, with both, under the same vLLM hashes. Indexed for state
        as _store would; (kvroute hash, vLLM hash) of those known, as the others are skipped."""
        holdings = self._holdings
        blocks, holders, bit = state.blocks[tier], holdings.holders[tier], state.bit
        find, bump = holdings.find, 1 if counted else 0
        known: list[tuple[int, BlockHash]] = []
        for vllm_hash in reversed(event.block_hashes):  # tail first, as _store
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
                holdings.entries += 1
            elif packed & COUNT_MASK != COUNT_MASK:
                packed += bump
            blocks[key] = packed
            known.append((packed >> COUNT_BITS, vllm_hash))
        self.stats.stored += len(known)
        return known
