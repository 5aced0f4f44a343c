"""kvroute's own chained block hash, computed identically from engine events and from prompts.

Reproducing vLLM's block hash has broken consumers many times (hash algorithm, pickle vs cbor, seeds),
so the router hashes token ids itself: block i's hash is xxh3_64 of its token ids (as uint32) seeded with
block i-1's hash. The first block is seeded with a root that folds in the LoRA adapter, because the same
tokens under another adapter are another cache entry.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec
import xxhash

try:
    from router.prompt._chain_kernel import chain_hashes
except ImportError as error:  # a source tree whose compiled core was never built, or built for another Python
    raise ImportError(f"kvroute's compiled core is not built ({error}): run `make setup`") from error

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
    if extra_keys is None or extra_keys.count(None) == len(extra_keys):  # vLLM's event for most requests
        return chain_hashes(token_ids, block_size, parent)
    data = _full_blocks(token_ids, block_size)
    step = block_size * 4
    hashes: list[int] = []
    for index in range(len(data) // step):  # an engine's event with its blocks' own keys: rare, and short
        if extra_keys[index] is not None:
            parent = _xxh3(_pack(extra_keys[index]), parent)
        parent = _xxh3(data[index * step : (index + 1) * step], parent)
        hashes.append(parent)
    return hashes


def prompt_chain(token_ids: Sequence[int], block_size: int, key: PromptKey = PLAIN) -> list[int]:
    """A prompt's block hashes as its engine's events give them (prompt_key). Hashed whole every time: in
    the compiled kernel that takes less than telling a later turn's shared prefix from a new one would."""
    return chain_hashes(token_ids, block_size, key.root, later=key.later)


def _full_blocks(token_ids: Sequence[int], block_size: int) -> bytes:
    """The full blocks' token ids as uint32 bytes."""
    data = array("I", token_ids)
    del data[len(data) // block_size * block_size :]
    return data.tobytes()
