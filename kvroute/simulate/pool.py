"""The shared Mooncake pool: blocks every instance writes as it computes them, any instance can load.

Capacity in blocks, least recently used evicted first, silently (the master announces nothing, which is why
the router confirms pool credit before counting it). A load refreshes what it reads.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence


def pool_hash(block_hash: int) -> bytes:
    """A block's full hash in its pool key and in the event announcing it: the chain hash's 8 bytes (the
    simulated engines hash as kvroute does)."""
    return block_hash.to_bytes(8, "big")


class PoolStore:
    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def write(self, hashes: Sequence[int]) -> list[int]:
        """Store hashes; returns those that were not there already (the writes an event announces)."""
        blocks = self._blocks
        new = [h for h in hashes if h not in blocks]
        for block_hash in new:
            blocks[block_hash] = None
        excess = len(blocks) - self.capacity
        for _ in range(max(excess, 0)):
            blocks.popitem(last=False)
        self.evicted += max(excess, 0)
        return new

    def prefix(self, chain: Sequence[int], start: int, limit: int) -> int:
        """How many of chain[start:limit] the pool holds contiguously from start; those are refreshed."""
        blocks = self._blocks
        count = 0
        for block_hash in itertools.islice(chain, start, limit):
            if block_hash not in blocks:
                break
            blocks.move_to_end(block_hash)
            count += 1
        return count


class StoreLookup:
    """The pool answers the router's lookups as the Mooncake master does: which of these blocks it holds now
    (router/index/pool.py's PoolLookup), without a round trip."""

    def __init__(self, pool: PoolStore) -> None:
        self._pool = pool

    async def __call__(self, pool_name: str, vllm_hashes: list[bytes]) -> set[bytes]:
        return {h for h in vllm_hashes if int.from_bytes(h, "big") in self._pool}
