"""A block index fed the KV-event batches a real engine published, as a capture script recorded them."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from router.index.block_index import BlockIndex
from router.index.events import EventDecoder


def index_of_batches(frames: Sequence[Sequence[bytes]], seqs: Collection[int], block_size: int) -> BlockIndex:
    """The index of one instance after the captured batches (topic, seq, payload) numbered in seqs."""
    index, decoder = BlockIndex(block_size), EventDecoder()
    for _topic, seq, payload in frames:
        if int.from_bytes(seq, "big") in seqs:
            index.apply(("vllm", 0), decoder.decode(payload).events)
    assert index.stats.mismatched == 0
    return index
