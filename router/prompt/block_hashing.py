"""kvroute's own chained block hash, computed identically from engine events and from prompts.

Reproducing vLLM's block hash has broken consumers many times (hash algorithm, pickle vs cbor, seeds),
so the router hashes token ids itself: block i's hash is xxh3_64 of its token ids (as uint32) seeded with
block i-1's hash. The first block is seeded with a root that folds in the LoRA adapter, because the same
tokens under another adapter are another cache entry.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec
import xxhash

ROOT = 0
_xxh3 = xxhash.xxh3_64_intdigest
_pack = msgspec.msgpack.Encoder().encode


def root_for(lora_name: str | None) -> int:
    return ROOT if lora_name is None else _xxh3(b"lora\x00" + lora_name.encode())


class PromptKey(NamedTuple):
    """What keys a prompt's blocks besides their tokens, as the engine's events announce it: vLLM's extra
    keys, which chain() mixes into a block's parent before the block. The first block's are folded into root;
    later, when set, is mixed in before every later block."""

    root: int
    later: bytes | None = None


PLAIN = PromptKey(ROOT)


def prompt_key(cache_salt: str | None = None, lora_name: str | None = None) -> PromptKey:
    """vLLM announces a request's cache_salt in its first block's extra keys, and a LoRA adapter's name in
    every block's (before the salt), with the adapter's root under the first block (root_for)."""
    if lora_name is None:
        return PromptKey(_xxh3(_pack((cache_salt,)), ROOT)) if cache_salt else PLAIN
    first = (lora_name, cache_salt) if cache_salt else (lora_name,)
    return PromptKey(_xxh3(_pack(first), root_for(lora_name)), _pack((lora_name,)))


def chain(
    token_ids: Sequence[int],
    block_size: int,
    parent: int = ROOT,
    extra_keys: Sequence[Any] | None = None,
) -> list[int]:
    """Hashes of the full blocks of token_ids, chained from parent; a partial last block is not hashed.

    extra_keys, when given, holds one entry per block (None for most) mixed into that block's hash.
    """
    data = _full_blocks(token_ids, block_size)
    step = block_size * 4
    if extra_keys is not None and any(key is not None for key in extra_keys):
        hashes: list[int] = []
        for index in range(len(data) // step):
            if extra_keys[index] is not None:
                parent = _xxh3(_pack(extra_keys[index]), parent)
            parent = _xxh3(data[index * step : (index + 1) * step], parent)
            hashes.append(parent)
        return hashes
    return _chain_from(data, step, parent)


def _full_blocks(token_ids: Sequence[int], block_size: int) -> bytes:
    """The full blocks' token ids as uint32 bytes."""
    data = array("I", token_ids)
    del data[len(data) // block_size * block_size :]
    return data.tobytes()


def _chain_from(data: bytes, step: int, parent: int, start: int = 0, later: bytes | None = None) -> list[int]:
    """The chained hashes of data's blocks of step bytes, from byte start on; later: extra keys mixed in
    before every block but the first (PromptKey)."""
    hashes: list[int] = []
    append = hashes.append
    if later is None:
        for offset in range(start, len(data), step):  # the hot loop: positional seed, bytes slices, no index
            parent = _xxh3(data[offset : offset + step], parent)
            append(parent)
        return hashes
    for offset in range(start, len(data), step):
        if offset:
            parent = _xxh3(later, parent)
        parent = _xxh3(data[offset : offset + step], parent)
        append(parent)
    return hashes


class ChainCache:
    """Reuses the block hashes of recent prompts: an agent's turn resends the previous turn verbatim.

    Every `stride` blocks of a hashed prompt, a digest of its token bytes so far is remembered together with
    its chain; a later prompt hashes only from the longest remembered boundary it shares. Bounded by the
    number of chains kept, oldest first.
    """

    def __init__(self, block_size: int, stride: int = 64, max_chains: int = 256) -> None:
        self.block_size, self.stride, self.max_chains = block_size, stride, max_chains
        self._chains: OrderedDict[int, tuple[list[int], list[int]]] = OrderedDict()  # id -> (chain, digests)
        self._boundaries: dict[int, tuple[int, int]] = {}  # digest -> (chain id, blocks before it)
        self._next_id = 0
        self.reused_blocks = 0

    def chain(self, token_ids: Sequence[int], key: PromptKey = PLAIN) -> list[int]:
        size, stride = self.block_size, self.stride
        data = _full_blocks(token_ids, size)  # converted once: the digests and the tail's hashes read it
        if len(data) < stride * size * 4:
            return _chain_from(data, size * 4, key.root, later=key.later)
        view, span = memoryview(data), size * 4 * stride
        # Seeded with the root, which differs for every salt and adapter: their chains are not shared.
        streaming = xxhash.xxh3_64(seed=key.root)
        digests = []
        for end in range(span, len(data) + 1, span):
            streaming.update(view[end - span : end])
            digests.append(streaming.intdigest())
        hashes: list[int] = []
        for digest in reversed(digests):
            found = self._boundaries.get(digest)
            if found is not None:
                chain_id, blocks = found
                hashes = self._chains[chain_id][0][:blocks]
                self._chains.move_to_end(chain_id)
                break
        self.reused_blocks += len(hashes)
        parent = hashes[-1] if hashes else key.root
        hashes += _chain_from(data, size * 4, parent, start=len(hashes) * size * 4, later=key.later)
        self._remember(hashes, digests)
        return hashes

    def __len__(self) -> int:
        return len(self._chains)

    def _remember(self, hashes: list[int], digests: list[int]) -> None:
        chain_id, self._next_id = self._next_id, self._next_id + 1
        self._chains[chain_id] = (hashes, digests)
        for number, digest in enumerate(digests, start=1):
            self._boundaries[digest] = (chain_id, number * self.stride)
        while len(self._chains) > self.max_chains:
            old_id, (_, old_digests) = self._chains.popitem(last=False)
            for digest in old_digests:
                if self._boundaries.get(digest, (None, 0))[0] == old_id:
                    del self._boundaries[digest]
