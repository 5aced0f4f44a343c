"""An instance's KV cache with vLLM's prefix-caching semantics, keyed by block hash for speed.

The semantics are fleet/block_pool.py's (vLLM's BlockPool): only full blocks are cached; a finished
request's blocks go to the tail of one free queue, its last blocks first, and stay cached until the head of
that queue is reused; reusing a cached block announces nothing; evicting one announces BlockRemoved. Blocks
are not objects here, a cached block is its hash and an uncached free block a negative placeholder: the
simulation moves millions of blocks per run. One difference: a block computed while another request already
cached the same hash is kept uncached (vLLM caches the copy too and announces it again; the index ends in
the same state).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

from router.index.events import BlockRemoved, BlockStored, KVEvent


class KVCache:
    def __init__(self, num_blocks: int, block_size: int, medium: str = "GPU") -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.medium = medium
        self.events: list[KVEvent] = []
        self.evicted = 0
        self._never_used = num_blocks
        self._refs: dict[int, int] = {}  # cached hash -> requests using it
        self._free: OrderedDict[int, None] = (
            OrderedDict()
        )  # LRU first: cached hashes, or negative placeholders
        self._placeholder = 0

    @property
    def num_free(self) -> int:
        """Blocks a request can take: never used, uncached free, or cached but unreferenced."""
        return self._never_used + len(self._free)

    @property
    def usage(self) -> float:
        """As vLLM's kv_cache_usage_perc: cached but unreferenced blocks count as free."""
        return 1.0 - self.num_free / self.num_blocks

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._refs

    def cached_prefix(self, chain: Sequence[int], start: int, limit: int) -> int:
        """How many of chain[start:limit] are cached, contiguously from start."""
        refs = self._refs
        count = 0
        for block_hash in itertools.islice(chain, start, limit):
            if block_hash not in refs:
                break
            count += 1
        return count

    def can_take(self, hits: Sequence[int], new_blocks: int) -> bool:
        """Whether hits can be referenced and new_blocks allocated on top of them."""
        refs = self._refs
        unreferenced = sum(1 for h in hits if refs[h] == 0)
        return new_blocks <= self.num_free - unreferenced

    def touch(self, hits: Sequence[int]) -> None:
        refs, free = self._refs, self._free
        for block_hash in hits:
            count = refs[block_hash]
            if count == 0:
                del free[block_hash]
            refs[block_hash] = count + 1

    def allocate(self, count: int) -> None:
        """Take count blocks, never used ones first, then from the head of the free queue (evicting)."""
        fresh = min(count, self._never_used)
        self._never_used -= fresh
        removed: list[int] = []
        free, refs = self._free, self._refs
        for _ in range(count - fresh):
            key, _ = free.popitem(last=False)
            if key >= 0:
                del refs[key]
                removed.append(key)
        if removed:
            self.evicted += len(removed)
            self.events.append(BlockRemoved(block_hashes=removed, medium=self.medium))  # type: ignore[arg-type]

    def cache(self, hashes: Sequence[int], parent: int | None, tokens: Sequence[int]) -> list[int]:
        """Cache consecutive newly computed blocks of one request (allocated, so far uncached); returns
        the hashes it now references, the ones another request had not cached first."""
        refs, size = self._refs, self.block_size
        taken: list[int] = []
        run_start = 0
        for position, block_hash in enumerate(hashes):
            if block_hash in refs:  # cached by another request meanwhile: this copy stays uncached
                self._announce(hashes, run_start, position, parent, tokens, size)
                run_start = position + 1
                parent = block_hash
                continue
            refs[block_hash] = 1
            taken.append(block_hash)
        self._announce(hashes, run_start, len(hashes), parent, tokens, size)
        return taken

    def _announce(
        self,
        hashes: Sequence[int],
        start: int,
        end: int,
        parent: int | None,
        tokens: Sequence[int],
        size: int,
    ) -> None:
        if end <= start:
            return
        self.events.append(
            BlockStored(
                block_hashes=list(hashes[start:end]),
                parent_block_hash=hashes[start - 1] if start else parent,
                token_ids=list(tokens[start * size : end * size]),
                block_size=size,
                lora_id=None,
                medium=self.medium,
                lora_name=None,
            )
        )

    def free(self, held: Sequence[int], uncached: int) -> None:
        """Release a request's blocks as vLLM does, last first: its uncached (decode, partial, duplicate)
        blocks, then its cached ones from the end of the prompt."""
        free, refs = self._free, self._refs
        for _ in range(uncached):
            self._placeholder -= 1
            free[self._placeholder] = None
        for block_hash in reversed(held):
            count = refs[block_hash] - 1
            refs[block_hash] = count
            if count == 0:
                free[block_hash] = None

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events
