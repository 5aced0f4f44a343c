"""What the index benchmarks share: the KV events they feed it, and how an action is timed."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from router.index.events import BlockHash, BlockStored

BLOCK_SIZE = 16


def gpu_blocks(
    hashes: Sequence[BlockHash],
    tokens: list[int],
    parent: BlockHash | None = None,
    block_size: int = BLOCK_SIZE,
) -> BlockStored:
    """A BlockStored event of GPU blocks of block_size tokens, no adapter, as vLLM 0.32 announces a prefill:
    no extra keys for any block, in the model's one full-attention group."""
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=block_size,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[None] * len(hashes),
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )


def durations(action: Callable[[], object], repeats: int) -> list[float]:
    """Seconds each of repeats calls of action took."""
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        samples.append(time.perf_counter() - started)
    return samples
