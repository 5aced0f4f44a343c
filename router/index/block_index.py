"""The global block index: which instance holds which prompt blocks, in which tier, from their KV events.

BlockIndex is the one object the router, the simulator and the tests hold; its parts are modules of their own:
- router/index/holdings.py: the tables (per tier, each block's holders as an owner bitmask; per owner, its
  entries by vLLM hash with reference counts), the owners' bits and the bound on entries;
- router/index/ingest.py: KV event batches into those tables;
- router/index/matching.py: a prompt's block chain against them, each instance's prefix by best tier;
- router/index/speculation.py: routed requests' blocks, counted until their events arrive;
- router/index/pool_tier.py: the Mooncake pool's blocks, one pseudo-owner per pool name;
- router/index/kv_groups.py: hybrid models' sliding-window and Mamba groups, which cut their matches.
An owner is (instance, data parallel rank): ranks publish separately and are cleared separately.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager

from router.index.events import AllBlocksCleared, KVEvent
from router.index.holdings import DEFAULT_MEDIUM_TIERS, Holdings, IndexStats, Owner, Tier
from router.index.ingest import Ingest
from router.index.kv_groups import GroupConstraints
from router.index.matching import Matcher
from router.index.pool_tier import PoolTier
from router.index.speculation import Speculation, Speculations
from scorers.request import TierMatch

__all__ = ["DEFAULT_MEDIUM_TIERS", "BlockIndex", "IndexStats", "Owner", "Speculation", "Tier"]


class BlockIndex:
    def __init__(
        self,
        block_size: int,
        max_entries: int = 10_000_000,
        speculative_ttl_s: float = 2.0,
        medium_tiers: Mapping[str | None, Tier] = DEFAULT_MEDIUM_TIERS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.block_size = block_size
        self.stats = IndexStats()
        self._holdings = Holdings(max_entries, self.stats)
        self._speculations = Speculations(speculative_ttl_s, clock)
        self._pools = PoolTier(self._holdings)
        # A hybrid model's sliding-window and Mamba groups, which cut what its full-attention blocks match.
        self._groups = GroupConstraints(block_size, max_entries)
        self._ingest = Ingest(block_size, medium_tiers, self._holdings, self._pools, self._groups)
        self._matcher = Matcher(self._holdings, self._speculations, self._groups)

    @property
    def max_entries(self) -> int:
        return self._holdings.max_entries

    # ---- events -------------------------------------------------------------------------------------

    def apply(self, owner: Owner, events: Sequence[KVEvent]) -> None:
        """One batch of an owner's KV events, in order."""
        self._ingest.apply(self._holdings.owner(owner), self._pools.of(owner[0]), events)

    def apply_in_steps(self, owner: Owner, events: Sequence[KVEvent], step_blocks: int) -> Iterator[None]:
        """apply(owner, events) in steps of about step_blocks blocks, for a caller that gives others turns
        between them (router/index/ingest.py says what a lookup between two sees). The caller stops taking
        steps when the owner is dropped or forgotten meanwhile."""
        state, pool = self._holdings.owner(owner), self._pools.of(owner[0])
        return self._ingest.apply_in_steps(state, pool, events, step_blocks)

    def drop_instance(self, instance: str) -> None:
        """Forget everything every rank of instance holds (it restarted)."""
        for state in self._holdings.of_instance(instance):
            self._holdings.clear(state)
            self._groups.clear(state.bit)

    def cache_reset(self, instance: str) -> None:
        """instance emptied its prefix cache (/reset_prefix_cache): what its AllBlocksCleared will do when it
        comes (with its next engine step) done now, and the blocks of requests just sent there no longer
        counted as on their way."""
        states = self._holdings.of_instance(instance)
        for state in states:
            self._ingest.apply(state, self._pools.of(instance), [AllBlocksCleared()])
        self._speculations.forget(state.bit for state in states)

    def forget_instance(self, instance: str) -> None:
        """instance left the fleet: its entries, its pool membership and its owner bits go, and the bits are
        given to instances added later. Kept, they would grow every mask by a bit per name ever seen (a fleet
        whose pod names change at each rollout)."""
        self.drop_instance(instance)
        self.leave_pool(instance)
        bits = self._holdings.retire(instance)
        for bit in bits:
            self._groups.forget(bit)
        self._speculations.forget(bits)

    def drop(self, owner: Owner) -> None:
        """Forget everything an owner holds (engine restart, lost events)."""
        state = self._holdings.owners.get(owner)
        if state is not None:
            self._holdings.clear(state)
            self._groups.clear(state.bit)

    # ---- the pool's members -------------------------------------------------------------------------

    def set_pool_name(self, instance: str, pool_name: str) -> None:
        """instance's model is named pool_name in Mooncake keys: the pool blocks it writes are pool_name's,
        and of the pool's blocks only pool_name's count for it."""
        self._pools.set_pool_name(instance, pool_name)

    def join_pool(self, instance: str) -> None:
        """Count its pool name's entries for instance before it has written to the pool (it is configured to
        read it)."""
        self._pools.join(self._holdings.owner((instance, 0)), self._pools.of(instance))

    def leave_pool(self, instance: str) -> None:
        """instance left the fleet: pool entries no longer count for it, and its pool name is forgotten."""
        self._pools.leave(instance)

    # ---- routing ------------------------------------------------------------------------------------

    def match(
        self, chain: Sequence[int], include_pool: bool = True, reusable: int | None = None
    ) -> dict[str, TierMatch]:
        """For every instance holding a prefix of chain: its contiguous matched blocks, by best tier.

        Speculative entries count as GPU blocks. Of one instance's ranks, the best match counts.
        Pool blocks count for every member of their pool name, unless include_pool is False. reusable: the
        blocks the engine may reuse (all but the last prompt token's), within which a hybrid model's other
        KV cache groups decide its hit as vLLM does; None: all of chain.
        """
        return self._matcher.match(chain, include_pool, reusable)

    def match_with_own(
        self, chain: Sequence[int], reusable: int | None = None
    ) -> tuple[dict[str, TierMatch], dict[str, TierMatch]]:
        """match(chain) and match(chain, include_pool=False) from one probe of the tiers: the instances' own
        prefixes are where the pool credit to confirm begins (router/index/pool.py)."""
        return self._matcher.match_with_own(chain, reusable)

    def pooled(
        self, chain: Sequence[int], start: int, end: int, pool_name: str = ""
    ) -> list[tuple[int, bytes]]:
        """(position, vLLM's full hash) of pool_name's pool blocks among chain[start:end]."""
        return self._pools.pooled(chain, start, end, pool_name)

    def forget_pooled(self, vllm_hashes: Sequence[bytes], pool_name: str = "") -> None:
        """Drop pool_name's entries the pool no longer holds (evicted, or lost with a client's segment)."""
        self._pools.forget_pooled(vllm_hashes, pool_name)

    def asking(self, vllm_hashes: Iterable[bytes], pool_name: str = "") -> AbstractContextManager[set[bytes]]:
        """For a lookup of vllm_hashes on the master: the set of those not stored in pool_name's pool again
        while the block runs. The master's "missing" for one stored again predates the new copy."""
        return self._pools.asking(vllm_hashes, pool_name)

    def reused(self, instance: str, chain: Sequence[int], end: int) -> None:
        """A request routed to instance reuses its blocks chain[:end] there: vLLM's LRU keeps them, so the
        bound gives them a second chance. Noted only past half the bound, where eviction is near: below it
        this costs nothing."""
        self._holdings.reused(instance, chain, end)

    def routed(self, instance: str, chain: Sequence[int], held: int) -> Speculation | None:
        """A request was routed to instance, which holds chain[:held]: those blocks are reused there, the
        rest entered as speculative (None when there is no rest)."""
        self.reused(instance, chain, held)
        return self.speculate(instance, chain, start=held) if len(chain) > held else None

    def speculate(self, instance: str, chain: Sequence[int], start: int = 0) -> Speculation:
        """Enter a routed request's blocks (from chain[start]) for its instance until their events arrive;
        returns what was entered, for withdraw."""
        return self._speculations.enter(self._holdings.owner((instance, 0)).bit, chain, start)

    def withdraw(self, instance: str, speculation: Speculation) -> None:
        """A routed request that never ran there (refused, or the instance failed it): its speculative
        blocks go now rather than at their deadline. Another request's speculation of the same blocks on the
        same instance goes too; the events of what that one computes enter them for real."""
        state = self._holdings.owners.get((instance, 0))
        self._speculations.withdraw(None if state is None else state.bit, speculation)

    # ---- observation --------------------------------------------------------------------------------

    @property
    def entries(self) -> int:
        return self._holdings.entries

    def entries_by_owner(self) -> dict[Owner, tuple[int, ...]]:
        """Entries per instance and rank, by tier; the shared pool's are in pool_entries."""
        return {owner: tuple(len(b) for b in state.blocks) for owner, state in self._holdings.owners.items()}

    @property
    def pool_entries(self) -> int:
        return self._pools.entries

    def pool_members(self) -> list[str]:
        """Instances that read the pool: configured to, or shown to by writing to it."""
        return self._pools.members()

    def pool_name(self, instance: str) -> str:
        """The pool name whose pool entries count for instance ("" when it was never given one)."""
        return self._pools.name_of(instance)

    def footprint_bytes(self, sample: int = 256) -> int:
        """Memory held by the index: its compiled tables exactly, its dicts' tables exactly and their key and
        value objects sized from a sample of each."""
        holdings, pools = self._holdings, list(self._pools.states())
        tables = [*holdings.holders, *(b for s in [*holdings.owners.values(), *pools] for b in s.blocks)]
        dicts: list[Mapping[int, int | bytes]] = [
            self._speculations.pending,
            *(pool.hashes for pool in pools),
        ]
        total = sum(map(sys.getsizeof, tables))
        for mapping in dicts:
            total += sys.getsizeof(mapping)
            if mapping:
                items = list(itertools.islice(mapping.items(), sample))
                per_item = sum(_object_bytes(k) + _object_bytes(v) for k, v in items) / len(items)
                total += int(per_item * len(mapping))
        return total


def _object_bytes(value: int | bytes) -> int:
    """CPython shares the ints -5..256: an owner mask of 1, 2 or 4 costs its dict slot only."""
    return 0 if isinstance(value, int) and -5 <= value <= 256 else sys.getsizeof(value)
