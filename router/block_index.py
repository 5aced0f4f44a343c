"""The global block index: which instance holds which prompt blocks, in which tier, from their KV events.

Layout, chosen for lookup speed and memory:
- per tier, one dict from kvroute's block hash to a bitmask of the owners holding it, so matching a prompt
  costs one dict probe per block for the whole fleet, however many instances it has;
- per owner and tier, a dict from vLLM's block hash (low 64 bits) to kvroute's hash packed with a reference
  count, so BlockRemoved resolves and a block stored twice survives one removal.
An owner is (instance, data parallel rank): ranks publish separately and are cleared separately.
Entries are bounded: past max_entries, the least recently stored entries of the largest owner go first.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import operator
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import cast

from router import block_hashing
from router.kv_events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent
from scorers.base import TierMatch

log = logging.getLogger(__name__)

Owner = tuple[str, int]
"""(instance name, data parallel rank)"""

_COUNT_BITS = 16
_COUNT_MASK = (1 << _COUNT_BITS) - 1
_LOW64 = (1 << 64) - 1


class Tier(IntEnum):
    GPU = 0
    CPU = 1
    POOL = 2


DEFAULT_MEDIUM_TIERS: Mapping[str | None, Tier] = {
    None: Tier.GPU, "GPU": Tier.GPU, "gpu": Tier.GPU, "CPU": Tier.CPU, "cpu": Tier.CPU, "STORAGE": Tier.CPU,
}  # fmt: skip


def _key(vllm_hash: BlockHash) -> int:
    """vLLM's hash as a 64-bit int: integer hashes already are; bytes hashes keep their low 64 bits."""
    if isinstance(vllm_hash, bytes):
        return int.from_bytes(vllm_hash[-8:], "big")
    return vllm_hash & _LOW64


@dataclass
class _OwnerState:
    bit: int
    # per tier: vLLM key -> kvroute hash << 16 | refcount
    blocks: tuple[dict[int, int], ...] = field(default_factory=lambda: tuple({} for _ in Tier))

    def size(self) -> int:
        return sum(len(b) for b in self.blocks)


@dataclass
class IndexStats:
    stored: int = 0
    removed: int = 0
    orphaned: int = 0  # blocks whose parent the index never saw: their chain cannot be rebuilt
    evicted: int = 0  # dropped to stay within max_entries
    mismatched: int = 0  # events whose token count or block size does not fit the configured block size


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
        self._clock = clock
        self._holders: tuple[dict[int, int], ...] = tuple({} for _ in Tier)
        self._owners: dict[Owner, _OwnerState] = {}
        self._owner_by_bit: dict[int, Owner] = {}
        self._entries = 0
        self._pending: dict[int, int] = {}  # speculative: kvroute hash -> owner mask
        self._pending_until: dict[tuple[int, int], float] = {}  # (hash, owner bit) -> latest deadline
        self._pending_expiry: deque[tuple[float, int, int]] = deque()  # (deadline, hash, bit), in order

    # ---- events -------------------------------------------------------------------------------------

    def apply(self, owner: Owner, events: Sequence[KVEvent]) -> None:
        state = self._owner(owner)
        for event in events:
            if isinstance(event, BlockStored):
                if event.block_hashes:
                    self._store(state, event)
            elif isinstance(event, BlockRemoved):
                self._remove(state, self._tier(event.medium), event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self._clear(state)
        if self._entries > self.max_entries:
            self._shrink()

    def drop(self, owner: Owner) -> None:
        """Forget everything an owner holds (engine restart, lost events)."""
        state = self._owners.get(owner)
        if state is not None:
            self._clear(state)

    def _store(self, state: _OwnerState, event: BlockStored) -> None:
        size = self.block_size
        extra = event.extra_keys
        if (
            event.block_size != size
            or len(event.token_ids) != len(event.block_hashes) * size
            or (extra is not None and len(extra) != len(event.block_hashes))
            or max(event.token_ids) >= 1 << 32  # kvroute hashes token ids as uint32
        ):
            self.stats.mismatched += 1
            return
        tier = self._tier(event.medium)
        blocks = state.blocks[tier]
        if event.parent_block_hash is None:
            parent = block_hashing.root_for(event.lora_name)
        else:
            packed = self._find(state, _key(event.parent_block_hash))
            if packed is None:
                self.stats.orphaned += len(event.block_hashes)
                return
            parent = packed >> _COUNT_BITS
        own = block_hashing.chain(event.token_ids, size, parent, event.extra_keys)
        hashes = event.block_hashes
        # Integer hashes are vLLM's 64 bits already; only bytes hashes need converting.
        keys = cast(list[int], hashes) if type(hashes[0]) is int else [_key(h) for h in hashes]
        holders, bit = self._holders[tier], state.bit
        # Every key in an owner's map has its kvroute hash in the holders map, so blocks no one holds are
        # also new to this owner: the common case, bulk inserted in C, tail first (see below).
        if not any(map(holders.__contains__, own)):
            holders.update(zip(reversed(own), itertools.repeat(bit)))
            blocks.update(zip(reversed(keys), [(h << _COUNT_BITS) + 1 for h in reversed(own)], strict=True))
            self._entries += len(own)
            self.stats.stored += len(own)
            return
        pop, held = blocks.pop, holders.get
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
                blocks[key] = packed + 1 if packed & _COUNT_MASK != _COUNT_MASK else packed
        self._entries += added
        self.stats.stored += len(own)

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
            self._release(tier, packed >> _COUNT_BITS, state.bit)
            self.stats.removed += 1

    def _release(self, tier: Tier, own_hash: int, bit: int) -> None:
        holders = self._holders[tier]
        mask = holders.get(own_hash, 0) & ~bit
        if mask:
            holders[own_hash] = mask
        else:
            holders.pop(own_hash, None)
        self._entries -= 1

    def _clear(self, state: _OwnerState) -> None:
        for tier, blocks in zip(Tier, state.blocks, strict=True):
            for packed in blocks.values():
                self._release(tier, packed >> _COUNT_BITS, state.bit)
            blocks.clear()

    def _shrink(self) -> None:
        """Evict down to 99% of the bound, in batches from the front of the largest owner's largest map
        (one by one, each front lookup would rescan the slots of the entries popped before it); a batch is at
        most 1/16 of that owner, so owners shrink evenly."""
        target = self.max_entries - self.max_entries // 100
        while self._entries > target:
            state = max(self._owners.values(), key=_OwnerState.size)
            tier = max(Tier, key=lambda t: len(state.blocks[t]))
            blocks = state.blocks[tier]
            batch = min(self._entries - target, max(1, state.size() // 16))
            for key in list(itertools.islice(blocks, batch)):
                self._release(tier, blocks.pop(key) >> _COUNT_BITS, state.bit)
                self.stats.evicted += 1

    def _find(self, state: _OwnerState, key: int) -> int | None:
        for blocks in state.blocks:
            packed = blocks.get(key)
            if packed is not None:
                return packed
        return None

    def _tier(self, medium: str | None) -> Tier:
        return self._medium_tiers.get(medium, Tier.CPU)

    def _owner(self, owner: Owner) -> _OwnerState:
        state = self._owners.get(owner)
        if state is None:
            bit = 1 << len(self._owners)
            state = self._owners[owner] = _OwnerState(bit)
            self._owner_by_bit[bit] = owner
        return state

    # ---- routing ------------------------------------------------------------------------------------

    def match(self, chain: Sequence[int]) -> dict[str, TierMatch]:
        """For every instance holding a prefix of chain: its contiguous matched blocks, by best tier.

        Speculative entries count as GPU blocks. Of one instance's ranks, the best match counts.
        """
        self._expire()
        tiers = [(tier, holders) for tier, holders in zip(Tier, self._holders, strict=True) if holders]
        if self._pending:
            tiers.append((Tier.GPU, self._pending))
        if not tiers or not chain:
            return {}
        # All in C: each block's holders, then the running AND (owners holding every block so far). It never
        # grows, so where an owner's bit leaves it is found by bisection.
        zeros = itertools.repeat(0)
        held = list(map(tiers[0][1].get, chain, zeros))
        for _, holders in tiers[1:]:
            held = list(map(operator.or_, held, map(holders.get, chain, zeros)))
        alive = list(itertools.accumulate(held, operator.and_))
        ends = {bit: _match_length(alive, bit) for bit in _bits(alive[0])}
        return self._attribute(chain, ends, tiers)

    def _attribute(
        self, chain: Sequence[int], ends: dict[int, int], tiers: list[tuple[Tier, dict[int, int]]]
    ) -> dict[str, TierMatch]:
        matches: dict[str, TierMatch] = {}
        mixed = any(tier != Tier.GPU for tier, _ in tiers)
        for bit, end in ends.items():
            if mixed:  # rare: credit each block to the best tier this owner holds it in
                counts = [0] * len(Tier)
                for block in chain[:end]:
                    counts[min(t for t, holders in tiers if holders.get(block, 0) & bit)] += 1
                found = TierMatch(*counts)
            else:
                found = TierMatch(gpu=end)
            name = self._owner_by_bit[bit][0]
            known = matches.get(name)
            if known is None or _total(found) > _total(known):
                matches[name] = found
        return matches

    def speculate(self, instance: str, chain: Sequence[int], start: int = 0) -> None:
        """Enter a routed request's blocks (from chain[start]) for its instance until their events arrive."""
        bit = self._owner((instance, 0)).bit
        deadline = self._clock() + self._ttl
        pending, until = self._pending, self._pending_until
        for block in itertools.islice(chain, start, None):
            pending[block] = pending.get(block, 0) | bit
            until[block, bit] = deadline
            self._pending_expiry.append((deadline, block, bit))

    def _expire(self) -> None:
        now, expiry, pending, until = self._clock(), self._pending_expiry, self._pending, self._pending_until
        while expiry and expiry[0][0] <= now:
            _, block, bit = expiry.popleft()
            if until.get((block, bit), 0.0) > now:  # speculated again since: the later deadline holds
                continue
            until.pop((block, bit), None)
            mask = pending.get(block, 0) & ~bit
            if mask:
                pending[block] = mask
            else:
                pending.pop(block, None)

    # ---- observation --------------------------------------------------------------------------------

    @property
    def entries(self) -> int:
        return self._entries

    def entries_by_owner(self) -> dict[Owner, tuple[int, ...]]:
        return {owner: tuple(len(b) for b in state.blocks) for owner, state in self._owners.items()}

    def footprint_bytes(self, sample: int = 256) -> int:
        """Memory held by the index: exact dict tables, key and value objects sized from a sample of each."""
        maps = [*self._holders, self._pending, *(b for s in self._owners.values() for b in s.blocks)]
        total = 0
        for mapping in maps:
            total += sys.getsizeof(mapping)
            if mapping:
                items = list(itertools.islice(mapping.items(), sample))
                per_item = sum(_object_bytes(k) + _object_bytes(v) for k, v in items) / len(items)
                total += int(per_item * len(mapping))
        return total


def _object_bytes(value: int) -> int:
    """CPython shares the ints -5..256: an owner mask of 1, 2 or 4 costs its dict slot only."""
    return 0 if -5 <= value <= 256 else sys.getsizeof(value)


def _match_length(alive: list[int], bit: int) -> int:
    """Blocks before bit leaves the running AND; the masks never gain bits, so this is a bisection."""
    return bisect.bisect_left(alive, True, key=lambda mask: not mask & bit)


def _bits(mask: int) -> list[int]:
    found = []
    while mask:
        low = mask & -mask
        found.append(low)
        mask ^= low
    return found


def _total(match: TierMatch) -> int:
    return match.gpu + match.cpu + match.pool
