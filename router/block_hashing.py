"""kvroute's own chained block hash, computed identically from engine events and from prompts.

Reproducing vLLM's block hash has broken consumers many times (hash algorithm, pickle vs cbor, seeds),
so the router hashes token ids itself: block i's hash is xxh3_64 of its token ids (as uint32) seeded with
block i-1's hash. The first block is seeded with a root that folds in the LoRA adapter, because the same
tokens under another adapter are another cache entry.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import msgspec
import xxhash

ROOT = 0
_xxh3 = xxhash.xxh3_64_intdigest
_pack = msgspec.msgpack.Encoder().encode


def root_for(lora_name: str | None) -> int:
    return ROOT if lora_name is None else _xxh3(b"lora\x00" + lora_name.encode())


def chain(
    token_ids: Sequence[int],
    block_size: int,
    parent: int = ROOT,
    extra_keys: Sequence[Any] | None = None,
) -> list[int]:
    """Hashes of the full blocks of token_ids, chained from parent; a partial last block is not hashed.

    extra_keys, when given, holds one entry per block (None for most) mixed into that block's hash.
    """
    count = len(token_ids) // block_size
    data = memoryview(array("I", token_ids[: count * block_size]).tobytes()) if count else memoryview(b"")
    step = block_size * 4
    hashes = [0] * count
    for index in range(count):
        if extra_keys is not None and extra_keys[index] is not None:
            parent = _xxh3(_pack(extra_keys[index]), seed=parent)
        parent = hashes[index] = _xxh3(data[index * step : (index + 1) * step], seed=parent)
    return hashes
