"""The KV memory the requests in flight on one engine hold, counted as the engine counts it.

Requests that share a prefix share its blocks in vLLM's prefix cache (a block is referenced, not copied), so
contexts in flight together take less memory than their prompts add up to: a shared system prompt, or the
turns of one conversation sent before the last one ended. Block hashes are chained, so a held block means its
whole prefix is held. Blocks are counted in grains of about 512 tokens, each known by the hash of its last
block: a prompt of 100K tokens is ~200 entries, not 6,250, at most one grain's tokens per request counted
twice.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

_GRAIN_TOKENS = 512


class InflightBlocks:
    def __init__(self, block_size: int) -> None:
        self._stride = max(1, _GRAIN_TOKENS // block_size)  # blocks a grain
        self._grain = self._stride * block_size  # tokens a grain
        self._refs: Counter[int] = Counter()  # a grain's last block hash -> requests in flight holding it
        self._loose = 0  # tokens past each request's last whole grain, counted per request

    @property
    def tokens(self) -> int:
        return len(self._refs) * self._grain + self._loose

    def add(self, chain: Sequence[int], tokens: int) -> None:
        """A request of tokens whose whole blocks hash to chain is held from now on."""
        grains = self._grains(chain)
        self._refs.update(grains)
        self._loose += tokens - len(grains) * self._grain

    def remove(self, chain: Sequence[int], tokens: int) -> None:
        refs, grains = self._refs, self._grains(chain)
        for grain in grains:
            left = refs[grain] - 1
            if left > 0:
                refs[grain] = left
            else:
                refs.pop(grain, None)  # an end that matches no start must not fail the request
        self._loose -= tokens - len(grains) * self._grain

    def shared_tokens(self, chain: Sequence[int]) -> int:
        """Tokens of chain's leading grains already held, which a new request would not take again."""
        refs, stride = self._refs, self._stride
        if not refs:
            return 0
        # Grain i ends at chain[(i + 1) * stride - 1]: read in place, not sliced out (this is asked of every
        # candidate whose memory a prompt would overfill, of every decision).
        low, high = 0, len(chain) // stride
        if not high or chain[stride - 1] not in refs:  # what most instances of a large fleet hold of it
            return 0
        while low < high:  # held grains are whole prefixes: the held part of chain is a prefix of it
            middle = (low + high) // 2
            if chain[(middle + 1) * stride - 1] in refs:
                low = middle + 1
            else:
                high = middle
        return low * self._grain

    def _grains(self, chain: Sequence[int]) -> Sequence[int]:
        return chain[self._stride - 1 :: self._stride]
