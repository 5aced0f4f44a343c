"""The keys vLLM 0.32 adds to a multimodal prompt's blocks (``v1/core/kv_cache_utils.py``,
``generate_block_hash_extra_keys``), as its KV events announce them, and the prompt's block hashes with them.

A block holds an item when their token ranges overlap (an item's range is its whole placeholder, the tokens
around its embeddings included). For each such item, in the order of their offsets, the block's keys carry
``[identifier, item offset - block start]``: negative in every block after the one the item starts in. A LoRA
adapter's name comes before them in every block, a cache salt after them in the first, and last, for a prompt
given as embeddings, the digest of the block's rows (router/apis/completions/prompt_embeds.py). The router
mixes each block's keys into its hash exactly as it does an event's (router/prompt/block_hashing.py
``chain``), so the prompt's hashes equal those the index keeps for the engine's blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from router.prompt import block_hashing


class Placed(NamedTuple):
    """One multimodal item in the prompt: its identifier and its placeholder's token range."""

    identifier: str
    offset: int
    length: int


def block_extra_keys(
    items: Sequence[Placed],
    prompt_tokens: int,
    block_size: int,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    embeds: Sequence[bytes] = (),
) -> list[list[Any] | None]:
    """Each full block's extra keys as the engine's BlockStored announces them (None: none); embeds: each full
    block's digest of its prompt_embeds rows."""
    keys: list[list[Any] | None] = []
    ordered = sorted(items, key=lambda item: item.offset)
    first = 0  # the first item that may still overlap a block: items end in offset order too
    for start in range(0, prompt_tokens - block_size + 1, block_size):
        end = start + block_size
        while first < len(ordered) and ordered[first].offset + ordered[first].length <= start:
            first += 1
        block: list[Any] = [] if lora_name is None else [lora_name]
        for item in ordered[first:]:
            if item.offset >= end:
                break
            block.append([item.identifier, item.offset - start])
        if cache_salt is not None and start == 0:
            block.append(cache_salt)
        if embeds:
            block.append(embeds[start // block_size])
        keys.append(block or None)
    return keys


def multimodal_chain(
    token_ids: Sequence[int],
    block_size: int,
    items: Sequence[Placed],
    lora_name: str | None = None,
    cache_salt: str | None = None,
    embeds: Sequence[bytes] = (),
) -> list[int]:
    """The prompt's block hashes with its items' keys, as the index computes them from the engine's events."""
    keys = block_extra_keys(items, len(token_ids), block_size, lora_name, cache_salt, embeds)
    return block_hashing.chain(token_ids, block_size, block_hashing.root_for(lora_name), keys)
