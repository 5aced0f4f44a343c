"""Deterministic output tokens for the simulated engine.

Only tokens that decode to printable ASCII are generated, so the text streamed token by token equals the
text of the whole output decoded at once (no UTF-8 sequence is ever split between tokens).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import xxhash

from fleet.engine import TokenSampler
from router.prompt.tokenization import PromptTokenizer


def printable_token_ids(tokenizer: PromptTokenizer) -> list[int]:
    ids = []
    for token_id in range(tokenizer.vocab_size):
        text = tokenizer.token_text(token_id)
        if text and text.isascii() and text.isprintable():
            ids.append(token_id)
    return ids


def request_seed(seed: object, temperature: object, prompt_ids: Sequence[int]) -> int:
    """An explicit seed, else the prompt itself for greedy decoding, else fresh randomness."""
    if type(seed) is int:
        return seed & 0xFFFF_FFFF_FFFF_FFFF
    if temperature == 0:
        return xxhash.xxh3_64_intdigest(repr(list(prompt_ids)).encode())
    return random.getrandbits(64)


def sampler(vocabulary: Sequence[int], seed: int) -> TokenSampler:
    def sample(position: int) -> int:
        return vocabulary[
            xxhash.xxh3_64_intdigest(position.to_bytes(8, "little"), seed=seed) % len(vocabulary)
        ]

    return sample
