"""Hybrid models' other KV cache groups (sliding window, Mamba): what a prefix hit needs from them too.

vLLM caches each KV cache group's blocks apart and announces each group's stores under its `group_idx`, with
the group's kind (vLLM >= 0.32). A prefix hit needs every group (vLLM's `find_longest_cache_hit` of each):
full attention needs the whole prefix, which the index's tiers hold; a sliding-window group needs the blocks
of the window that ends the prefix; a Mamba group needs its state at the prefix's last block, which it keeps
only at some blocks. Unmodelled, a new session sharing a system prompt with a Mamba hybrid's earlier one
would be credited the whole prompt where the engine reuses nothing.

Kept here: each owner's GPU blocks of those groups, under the kvroute hashes of the full-attention blocks at
the same positions (vLLM hashes a position's block once for all groups of one block size). A match is then
cut to the longest prefix that every group of its owner allows.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence

WINDOW_KINDS = frozenset({"sliding_window", "sliding_window_mla"})
STATE_KINDS = frozenset({"mamba"})
CONSTRAINING_KINDS = WINDOW_KINDS | STATE_KINDS

_COPY_BITS = 16
_COPIES = (1 << _COPY_BITS) - 1


class _Group:
    """One group of one owner: its blocks, and how many contiguous ones must end a hit."""

    __slots__ = ("ending_blocks", "held", "keys")

    def __init__(self, ending_blocks: int) -> None:
        self.ending_blocks = ending_blocks
        self.keys: dict[int, int] = {}  # vLLM key -> kvroute hash << 16 | copies, for BlockRemoved
        self.held: dict[int, int] = {}  # kvroute hash -> how many of the group's keys hold it

    def drop(self, key: int) -> None:
        block = self.keys.pop(key) >> _COPY_BITS
        count = self.held[block] - 1
        if count:
            self.held[block] = count
        else:
            del self.held[block]

    def longest(self, chain: Sequence[int], end: int, pending: Mapping[int, int], bit: int) -> int:
        """The longest hit of at most end blocks this group allows: as vLLM searches, from the right, for
        ending_blocks contiguous blocks it holds (or fewer, when they reach the prompt's first block). Blocks
        pending for the owner (routed there, not announced yet) count as held: the engine computes every
        group's blocks of a prompt."""
        held, needed, run = self.held, self.ending_blocks, 0
        if end >= needed and all(map(held.__contains__, chain[end - needed : end])):
            return end  # the common case, checked in C: the blocks that end the prefix are all held
        for position in range(end - 1, -1, -1):
            block = chain[position]
            if block in held or pending.get(block, 0) & bit:
                run += 1
                if run >= needed:
                    return position + needed
            else:
                run = 0
        return run


def ending_blocks(kind: str, sliding_window: int | None, block_size: int) -> int:
    """Contiguous blocks a hit must end with in a group of kind: a window's tokens before the next one
    (vLLM: cdiv(sliding_window - 1, block_size)), a Mamba state's one block."""
    if kind in WINDOW_KINDS and sliding_window:
        return max(1, -(-(sliding_window - 1) // block_size))
    return 1


class GroupConstraints:
    """Per owner (its index bit), the blocks of its constraining groups."""

    def __init__(self, block_size: int, max_entries: int) -> None:
        self.block_size, self.max_entries = block_size, max_entries
        self._owners: dict[int, dict[int | None, _Group]] = {}
        self._anchored: set[int] = set()  # owners with a full-attention group: those whose hits groups cut

    def __bool__(self) -> bool:
        return bool(self._owners)

    def anchored(self, bit: int) -> bool:
        return bit in self._anchored

    def anchor(self, bit: int) -> None:
        self._anchored.add(bit)

    def constrains(self, bit: int) -> bool:
        return bit in self._owners

    def is_group(self, bit: int, group_idx: int | None) -> bool:
        groups = self._owners.get(bit)
        return groups is not None and group_idx in groups

    def declare(self, bit: int, group_idx: int | None, kind: str, sliding_window: int | None) -> None:
        """The owner has a group group_idx of kind, which constrains its hits (from its first store)."""
        groups = self._owners.setdefault(bit, {})
        if group_idx not in groups:
            groups[group_idx] = _Group(ending_blocks(kind, sliding_window, self.block_size))

    def store(self, bit: int, group_idx: int | None, blocks: Iterable[tuple[int, int]]) -> None:
        """blocks: (vLLM key, kvroute hash) of a store event of a declared group."""
        group = self._owners[bit][group_idx]
        keys, held = group.keys, group.held
        for key, block in blocks:
            packed = keys.get(key)
            if packed is not None:  # another physical copy (vLLM announces and removes each one)
                keys[key] = packed + 1 if packed & _COPIES != _COPIES else packed
                continue
            keys[key] = (block << _COPY_BITS) + 1
            held[block] = held.get(block, 0) + 1
        if len(keys) > self.max_entries:  # a publisher that never removes: the oldest go, as in the index
            for key in list(itertools.islice(keys, len(keys) - self.max_entries)):
                group.drop(key)

    def remove(self, bit: int, group_idx: int | None, vllm_keys: Iterable[int]) -> None:
        group = self._owners.get(bit, {}).get(group_idx)
        if group is None:
            return
        keys = group.keys
        for key in vllm_keys:
            packed = keys.get(key)
            if packed is None:
                continue
            if packed & _COPIES > 1:
                keys[key] = packed - 1
            else:
                group.drop(key)

    def clear(self, bit: int) -> None:
        """The owner's GPU cache was reset, or its engine restarted: its groups keep their kinds only."""
        for group in self._owners.get(bit, {}).values():
            group.keys.clear()
            group.held.clear()

    def forget(self, bit: int) -> None:
        self._owners.pop(bit, None)
        self._anchored.discard(bit)

    def cut(self, bit: int, chain: Sequence[int], end: int, pending: Mapping[int, int]) -> int:
        """The longest prefix of chain[:end] every constraining group of the owner allows, as vLLM's hybrid
        coordinator finds it: each group's longest hit within the last bound, until they agree."""
        groups = self._owners.get(bit)
        if not groups:
            return end
        while end:
            agreed = min(group.longest(chain, end, pending, bit) for group in groups.values())
            if agreed == end:
                break
            end = agreed
        return end
