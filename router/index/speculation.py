"""Speculative entries: a routed request's blocks, counted as its instance's GPU blocks until their KV events
arrive (or their deadline passes, or the request is withdrawn)."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple


class Speculation(NamedTuple):
    """The blocks one routed request entered as pending at its instance, and until when."""

    blocks: list[int]
    until: float


class Speculations:
    """Pending blocks by owner bit (an instance's rank 0), each until the latest deadline it was entered with.

    A long prompt enters thousands of blocks: one expiry record per request, and a deadline of its own only
    for a block its instance already had pending.
    """

    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        self._ttl = ttl_s
        self._clock = clock
        self.pending: dict[int, int] = {}  # kvroute hash -> owner mask
        # owner bit -> hash -> latest deadline, for blocks speculated again while pending (the rest expire
        # with their request's record); small, so the common case touches one big map, not two
        self._respeculated: dict[int, dict[int, float]] = {}
        # one record per speculate call, (deadline, bit, hashes), oldest first
        self._expiry: deque[tuple[float, int, list[int]]] = deque()

    def enter(self, bit: int, chain: Sequence[int], start: int = 0) -> Speculation:
        """Enter chain[start:] as pending for the owner of bit, until ttl_s from now; returns what was
        entered, for withdraw."""
        deadline = self._clock() + self._ttl
        blocks = list(itertools.islice(chain, start, None))
        pending, later = self.pending, self._respeculated.setdefault(bit, {})
        for block in blocks:
            mask = pending.get(block, 0)
            if mask & bit or (later and block in later):  # pending, or withdrawn while its record lives
                later[block] = deadline
            if not mask & bit:
                pending[block] = mask | bit
        self._expiry.append((deadline, bit, blocks))
        return Speculation(blocks, deadline)

    def withdraw(self, bit: int | None, speculation: Speculation) -> None:
        """The speculation's blocks stop counting for the owner of bit now (None: an owner never seen)."""
        now = self._clock()
        if bit is None or now >= speculation.until:  # expired already: what is pending is others'
            return
        pending = self.pending
        later, keep = self._respeculated.setdefault(bit, {}), ~bit
        for block in speculation.blocks:
            # Its expiry record stays: a deadline already passed tells that record to let a later
            # speculation of the block stand, and goes with it.
            later[block] = now
            mask = pending.get(block, 0) & keep
            if mask:
                pending[block] = mask
            else:
                pending.pop(block, None)

    def expire(self) -> None:
        now, expiry, pending = self._clock(), self._expiry, self.pending
        while expiry and expiry[0][0] <= now:
            _, bit, blocks = expiry.popleft()
            later, keep = self._respeculated[bit], ~bit
            for block in blocks:
                if later:
                    until = later.get(block)
                    if until is not None:
                        if until > now:  # speculated again since: the later deadline holds
                            continue
                        del later[block]
                mask = pending.get(block, 0) & keep
                if mask:
                    pending[block] = mask
                else:
                    pending.pop(block, None)

    def forget(self, bits: Iterable[int]) -> None:
        """Owners that left: their pending blocks and records go, and their bits are free for others."""
        gone = 0
        for bit in bits:
            self._respeculated.pop(bit, None)
            gone |= bit
        if not gone:
            return
        keep = ~gone
        self.pending = {block: kept for block, mask in self.pending.items() if (kept := mask & keep)}
        self._expiry = deque(record for record in self._expiry if not record[1] & gone)

    def settled(self) -> bool:
        """Nothing pending and no later deadline kept: what expiry must leave once every deadline passed."""
        return not self.pending and not any(self._respeculated.values())
