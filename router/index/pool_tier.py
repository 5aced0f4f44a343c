"""The pool tier of the block index: one pseudo-owner per pool name.

Blocks a Mooncake connector wrote to the distributed pool are keyed there by their model's name (its pool
name) too, so they can be loaded by every instance connected to the pool that runs a model of the same pool
name. They are kept once per pool name, in a pseudo-owner whose bit is the mask of that pool name's members:
its instances that have written to the pool (the ones shown to be connected) or are configured to read it.
An instance's pool name comes from the configuration; instances never given one share the unnamed pool. The
pool never announces eviction, so its entries are checked against the Mooncake master, pool name by pool
name, before they decide a routing choice (router/index/pool.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence

from router.index.holdings import COUNT_BITS, Holdings, OwnerState, PoolState, Tier


class PoolTier:
    """The pool's pseudo-owners, one per pool name: each one's bit is the mask of its members (see join), so
    its entries count for all of them; entries are not refcounted, a pooled object is one object. An
    instance is in one pool name's mask at most, so the masks never overlap."""

    def __init__(self, holdings: Holdings) -> None:
        self._holdings = holdings
        self.unnamed = PoolState(bit=0)
        self._pools: dict[str, PoolState] = {"": self.unnamed}
        self._pool_of: dict[str, PoolState] = {}  # instance -> its pool name's pseudo-owner, when named

    def of(self, instance: str) -> PoolState:
        """The pseudo-owner of instance's pool name."""
        return self._pool_of.get(instance, self.unnamed)

    def named(self, pool_name: str) -> PoolState:
        """pool_name's pseudo-owner, made when new."""
        pool = self._pools.get(pool_name)
        if pool is None:
            pool = self._pools[pool_name] = PoolState(bit=0, name=pool_name)
        return pool

    def states(self) -> Iterable[PoolState]:
        return self._pools.values()

    # ---- membership ---------------------------------------------------------------------------------

    def set_pool_name(self, instance: str, pool_name: str) -> None:
        """instance's model is named pool_name in Mooncake keys: the pool blocks it writes are pool_name's,
        and of the pool's blocks only pool_name's count for it."""
        pool = self.named(pool_name)
        old = self.of(instance)
        if pool is old:
            return
        self._pool_of[instance] = pool
        moving = old.bit & self._holdings.bits_of(instance)
        if moving:
            self._set_members(old, old.bit & ~moving)
            self._set_members(pool, pool.bit | moving)

    def join(self, member: OwnerState, pool: PoolState) -> None:
        """An instance that writes to the pool is connected to it: its pool name's entries count for it."""
        if not pool.bit & member.bit:
            self._set_members(pool, pool.bit | member.bit)

    def leave(self, instance: str) -> None:
        """instance left the fleet: pool entries no longer count for it, and its pool name is forgotten."""
        pool, bits = self._pool_of.pop(instance, self.unnamed), self._holdings.bits_of(instance)
        if pool.bit & bits:
            self._set_members(pool, pool.bit & ~bits)

    def _set_members(self, pool: PoolState, members: int) -> None:
        """pool's entries count for members from now on; other pool names' bits in holders stay."""
        holders, old = self._holdings.holders[Tier.POOL], pool.bit
        pool.bit = members
        for packed in pool.blocks[Tier.POOL].values():
            own_hash = packed >> COUNT_BITS
            mask = (holders.get(own_hash, 0) & ~old) | members
            if mask:
                holders[own_hash] = mask
            else:
                holders.pop(own_hash, None)

    # ---- the master's lookups -----------------------------------------------------------------------

    def pooled(self, chain: Sequence[int], start: int, end: int, pool_name: str) -> list[tuple[int, bytes]]:
        """(position, vLLM's full hash) of pool_name's pool blocks among chain[start:end]."""
        pool = self._pools.get(pool_name)
        if pool is None:
            return []
        full = pool.hashes.get
        found = []
        for position in range(start, min(end, len(chain))):
            vllm_hash = full(chain[position])
            if vllm_hash is not None:
                found.append((position, vllm_hash))
        return found

    def forget_pooled(self, vllm_hashes: Sequence[bytes], pool_name: str) -> None:
        """Drop pool_name's entries the pool no longer holds (evicted, or lost with a client's segment)."""
        pool = self._pools.get(pool_name)
        if pool is not None:
            self._holdings.remove(pool, Tier.POOL, vllm_hashes)

    @contextlib.contextmanager
    def asking(self, vllm_hashes: Iterable[bytes], pool_name: str) -> Iterator[set[bytes]]:
        """For a lookup of vllm_hashes on the master: the set of those not stored in pool_name's pool again
        while the block runs. The master's "missing" for one stored again predates the new copy."""
        asked, unchanged = self.named(pool_name).asked, set(vllm_hashes)
        asked.append(unchanged)
        try:
            yield unchanged
        finally:
            asked[:] = [other for other in asked if other is not unchanged]  # equal sets are other lookups'

    # ---- observation --------------------------------------------------------------------------------

    @property
    def entries(self) -> int:
        return sum(len(pool.blocks[Tier.POOL]) for pool in self._pools.values())

    def members(self) -> list[str]:
        """Instances that read the pool: configured to, or shown to by writing to it."""
        members = 0
        for pool in self._pools.values():
            members |= pool.bit
        return sorted({name for at, (name, _) in self._holdings.owner_at.items() if members >> at & 1})

    def name_of(self, instance: str) -> str:
        """The pool name whose pool entries count for instance ("" when it was never given one)."""
        return self.of(instance).name
