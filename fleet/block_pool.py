"""A paged KV cache with vLLM's prefix-caching semantics, announcing changes as vLLM KV events.

Mirrors vLLM's BlockPool: only full blocks are cached, keyed by a chained block hash; a finished request's
blocks go to the tail of a free queue and stay cached until the head of that queue is reused (LRU); one
hash may be cached in several physical blocks; reusing a cached block announces nothing.
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import cbor2

from router.index.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent
from router.prompt.multimodal.block_keys import Placed, block_extra_keys

MEDIUM = "GPU"


@dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class NoFreeBlocks(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class Adapter:
    """A LoRA adapter an instance serves: its name, as requests give it, vLLM's id, 1 up in the order of
    --lora-modules, and the path given there (no weights are read; vLLM keys blocks by name and path)."""

    name: str
    id: int
    path: str = ""


class BlockHasher:
    """vLLM's block hash (`--prefix-caching-hash-algo`, sha256 or sha256_cbor): the hash of the serialized
    (parent hash, block tokens, extra keys), the first block's parent being NONE_HASH, the hash of the seed
    (PYTHONHASHSEED on a real instance). The same tokens, seed and keys give the hashes a real vLLM 0.32
    announces (tests/fleet/test_block_hashes.py)."""

    def __init__(self, seed: str = "0", algorithm: str = "sha256") -> None:
        self.algorithm, self._hash = algorithm, HASH_ALGORITHMS[algorithm]
        self._none_hash = self._hash(seed)

    def chain(
        self,
        token_ids: list[int],
        block_size: int,
        parent: bytes | None = None,
        salt: str | None = None,
        lora: Adapter | None = None,
        items: Sequence[Placed] = (),
    ) -> list[bytes]:
        """salt: vLLM's cache_salt, mixed into a sequence's first block only (parent None); lora: the adapter
        the request runs with, mixed into every block by name and path (its name when it has no path); items:
        the prompt's images, each mixed into the blocks it overlaps with its offset from the block's start
        (token_ids then start at the prompt's start)."""
        hashes: list[bytes] = []
        lora_keys = [] if lora is None else [("lora", lora.name, lora.path or lora.name)]
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            block = tuple(token_ids[start : start + block_size])
            end = start + block_size
            images = [
                ("mm", i.identifier, i.offset - start)
                for i in items
                if i.offset < end and start < i.offset + i.length
            ]
            keys = (
                [*lora_keys, *images, ("cache_salt", salt)]
                if salt and parent is None
                else [*lora_keys, *images]
            )
            parent = self._hash((parent or self._none_hash, block, tuple(keys) if keys else None))
            hashes.append(parent)
        return hashes


def _sha256(value: object) -> bytes:
    """vllm.utils.hashing.sha256: of the pickled value."""
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(value: object) -> bytes:
    """vllm.utils.hashing.sha256_cbor: of the canonical CBOR encoding, the same in any language."""
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


HASH_ALGORITHMS: dict[str, Callable[[object], bytes]] = {"sha256": _sha256, "sha256_cbor": _sha256_cbor}


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, int_hashes: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._int_hashes = int_hashes
        if num_blocks < 2:
            raise ValueError("a block pool needs at least 2 blocks (block 0 is reserved)")
        # Block 0 is vLLM's null block: never allocated, so num_blocks - 1 hold KV.
        self._blocks = [Block(i) for i in range(1, num_blocks)]
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self._blocks)
        self._cached: dict[bytes, dict[int, Block]] = {}
        self.pending_events: list[KVEvent] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def cached_hashes(self) -> int:
        """Distinct block hashes held: what a router's index should hold for this instance."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """As vLLM reports it: cached but unreferenced blocks count as free."""
        return 1.0 - len(self._free) / len(self._blocks)

    def wire_hash(self, block_hash: bytes) -> BlockHash:
        """vLLM sends the low 64 bits as an integer unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0."""
        return int.from_bytes(block_hash[-8:], "big") if self._int_hashes else block_hash

    def cached_prefix(self, block_hashes: list[bytes]) -> list[Block]:
        hits: list[Block] = []
        for block_hash in block_hashes:
            copies = self._cached.get(block_hash)
            if not copies:
                break
            hits.append(next(iter(copies.values())))
        return hits

    def touch(self, blocks: list[Block]) -> None:
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def allocate(self, count: int) -> list[Block]:
        if count > len(self._free):
            raise NoFreeBlocks(f"need {count} blocks, {len(self._free)} free")
        allocated = []
        for _ in range(count):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            allocated.append(block)
        return allocated

    def cache_blocks(
        self,
        blocks: list[Block],
        hashes: list[bytes],
        token_ids: list[int],
        parent: bytes | None,
        cache_salt: str | None = None,
        lora: Adapter | None = None,
        images: tuple[Sequence[Placed], int] = ((), 0),
    ) -> None:
        """Mark consecutive newly full blocks as cached; one BlockStored covers them all. As vLLM announces
        them, untagged: an adapter's name in every block's extra keys, its images' identifiers and offsets,
        then a salt in a sequence's first block's (parent None). images: the prompt's, and the index of the
        first of these blocks in it."""
        adapter = () if lora is None else (lora.name,)
        extra_keys: list[Any] = [adapter or None] * len(hashes)
        if cache_salt and parent is None and hashes:
            extra_keys[0] = (*adapter, cache_salt)
        items, first = images
        if items:
            keys = block_extra_keys(
                items,
                (first + len(hashes)) * self.block_size,
                self.block_size,
                None if lora is None else lora.name,
                cache_salt,
            )
            extra_keys = keys[first:]
        for block, block_hash in zip(blocks, hashes, strict=True):
            block.block_hash = block_hash
            self._cached.setdefault(block_hash, {})[block.block_id] = block
        self.pending_events.append(
            BlockStored(
                block_hashes=[self.wire_hash(h) for h in hashes],
                parent_block_hash=None if parent is None else self.wire_hash(parent),
                token_ids=token_ids,
                block_size=self.block_size,
                lora_id=None if lora is None else lora.id,
                medium=MEDIUM,
                lora_name=None if lora is None else lora.name,
                extra_keys=extra_keys,
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            )
        )

    def free(self, blocks: list[Block]) -> None:
        # Reversed, as vLLM does, so that a request's last blocks are evicted before its first ones.
        for block in reversed(blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def reset(self) -> bool:
        """Drop every cached block; refused (False) while any block is in use, as in vLLM."""
        if len(self._free) != len(self._blocks):
            return False
        for block in self._blocks:
            block.block_hash = None
        self._cached.clear()
        self.pending_events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        events, self.pending_events = self.pending_events, []
        return events

    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        copies = self._cached.get(block.block_hash)
        if copies is not None:
            copies.pop(block.block_id, None)
            if not copies:
                del self._cached[block.block_hash]
        self.pending_events.append(
            BlockRemoved(block_hashes=[self.wire_hash(block.block_hash)], medium=MEDIUM, group_idx=0)
        )
        block.block_hash = None
