"""KV events into the block index's tables: a batch of one owner's stores, removals and clears, in order.

Blocks are indexed under kvroute's hashes, computed from their tokens and extra keys along their parent's
chain; announcements without them (offloads, pool writes) take the hashes of the publisher's own copies under
the same vLLM hashes. A hybrid model's sliding-window and Mamba groups' blocks go to
router/index/kv_groups.py.
"""

from __future__ import annotations

import itertools
import logging
import sys
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import cast

from msgspec.structs import replace

from router.index.events import EVENT_TYPES, AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent
from router.index.holdings import COUNT_BITS, Holdings, OwnerState, PoolState, Tier, vllm_key, vllm_keys
from router.index.kv_groups import CONSTRAINING_KINDS, GroupConstraints
from router.index.pool_tier import PoolTier
from router.prompt import block_hashing

log = logging.getLogger(__name__)

# What vLLM's GPU block pool announces under: its events carry every block's extra keys (an adapter's name, a
# cache salt), so the blocks' kvroute hashes can be computed from them.
_GPU_MEDIA = frozenset({None, "GPU"})
# The event types Ingest.apply handles: a type registered in router/index/events.py but not here would be
# passed over in silence.
_HANDLED = (BlockStored, BlockRemoved, AllBlocksCleared)
if set(_HANDLED) != set(EVENT_TYPES):
    raise TypeError(f"BlockIndex.apply handles {_HANDLED}; router/index/events.py has {list(EVENT_TYPES)}")


# Steps of an unbounded size: apply's own, in one.
_WHOLE = sys.maxsize


@dataclass(slots=True)
class _Batch:
    """What a batch's earlier events tell its later ones, kept while it is applied (at once or in steps)."""

    events: Sequence[KVEvent]
    # vLLM's scheduler publishes its GPU block pool's events, then its connector's: an event of another medium
    # means the rest of the batch is the connector's.
    past_gpu: bool = False
    # Constraining groups' events, applied once the batch's full-attention blocks are in: a group's block
    # takes the kvroute hash of the full-attention block at its position, which may come later.
    grouped: list[BlockStored | BlockRemoved] = field(default_factory=list)
    hybrid: bool | None = None  # learnt once a batch, when a constraining group's store comes


class Ingest:
    def __init__(
        self,
        block_size: int,
        medium_tiers: Mapping[str | None, Tier],
        holdings: Holdings,
        pools: PoolTier,
        groups: GroupConstraints,
    ) -> None:
        self.block_size = block_size
        self._medium_tiers = medium_tiers
        # Where the GPU's blocks are kept: announced as "GPU" or with no medium (older vLLM).
        self._gpu_tiers = {medium_tiers[m] for m in (None, "GPU") if m in medium_tiers} or {Tier.GPU}
        # Where vLLM's offloading connectors' blocks are kept (an owner holds no pool entries of its own).
        self._offload_tiers = {self._tier(m) for m in ("CPU", "STORAGE")} - {Tier.POOL}
        self._holdings, self._pools, self._groups = holdings, pools, groups
        self.stats = holdings.stats
        self._warned_unkeyed = False

    def apply(self, state: OwnerState, pool: PoolState, events: Sequence[KVEvent]) -> None:
        """One batch of state's events; pool: its pool name's pseudo-owner."""
        batch = _Batch(events)
        self._take(state, pool, events, batch, None)
        if batch.grouped:
            self._apply_grouped(state, batch.grouped)
        if self._holdings.entries > self._holdings.max_entries:
            self._holdings.shrink(self._pools.states())

    def apply_in_steps(
        self, state: OwnerState, pool: PoolState, events: Sequence[KVEvent], step_blocks: int
    ) -> Iterator[None]:
        """apply, in steps of about step_blocks blocks, for a caller that lets others run between them.

        Run to its end, it has done what apply does (for a batch that names no block twice in one event). A
        lookup between two steps sees the batch up to some point and nothing after it: a store of more
        blocks than a step is hashed first, then entered from its end, so that none of it is
        reachable along a chain until all of it is; a removal of more may be seen in part, as if its blocks
        had come one an event, as vLLM sends them. The constraining groups' events come last, as in apply.
        """
        batch = _Batch(events)
        start = 0
        while start < len(events):
            end = work = 0
            for end, event in enumerate(itertools.islice(events, start, None), start=start + 1):  # noqa: B007
                work += 1 if isinstance(event, AllBlocksCleared) else len(event.block_hashes)
                if work >= step_blocks:
                    break
            taken, parts = self._take(state, pool, events[start:end], batch, step_blocks)
            start += taken
            if parts is not None:
                yield from parts  # which ends with a step of its own
            else:
                yield
        yield from self._grouped_in_steps(state, batch.grouped, step_blocks)
        if self._holdings.entries > self._holdings.max_entries:
            self._holdings.shrink(self._pools.states())

    def _take(
        self,
        state: OwnerState,
        pool: PoolState,
        events: Sequence[KVEvent],
        batch: _Batch,
        step: int | None,
    ) -> tuple[int, Iterator[None] | None]:
        """Apply events, batch's or a run of them, in order; the constraining groups' events are left in
        batch.grouped for the batch's end. With step, an event of more blocks than step ends the run. How
        many events were taken, and that event's application in steps (None when it was no such event)."""
        past_gpu, grouped, hybrid = batch.past_gpu, batch.grouped, batch.hybrid  # locals, for the loop
        holdings, size = self._holdings, self.block_size
        parts: Iterator[None] | None = None
        taken = 0
        for event in events:
            taken += 1
            if not isinstance(event, AllBlocksCleared) and event.medium not in _GPU_MEDIA:
                past_gpu = True
            if isinstance(event, BlockStored):
                if not event.block_hashes:
                    continue
                kind = event.kv_cache_spec_kind
                if kind in CONSTRAINING_KINDS and event.medium in _GPU_MEDIA:
                    hybrid = self._hybrid(state, batch.events) if hybrid is None else hybrid
                    if hybrid and event.block_size != self.block_size:  # not to be set beside the index's
                        self.stats.mismatched += 1
                        continue
                    if hybrid:
                        window = event.kv_cache_spec_sliding_window
                        self._groups.declare(state.bit, event.group_idx, kind, window)
                        grouped.append(event)
                        continue
                if event.medium in _GPU_MEDIA and (step is None or len(event.block_hashes) <= step):
                    tier = self._medium_tiers.get(event.medium, Tier.CPU)
                    if tier is not Tier.POOL and holdings.store_along(state, tier, event, pool, size):
                        continue  # what every engine step sends, in one compiled call
                parts = self._stored(state, pool, event, step)
                if parts is not None:
                    break
            elif isinstance(event, BlockRemoved):
                if event.medium in _GPU_MEDIA and self._groups.is_group(state.bit, event.group_idx):
                    grouped.append(event)
                    continue
                tier = self._tier(event.medium)
                owner, hashes = pool if tier is Tier.POOL else state, event.block_hashes
                if step is not None and len(hashes) > step:
                    parts = self._removed_in_steps(owner, tier, hashes, step)
                    break
                self._holdings.remove(owner, tier, hashes)
            elif isinstance(event, AllBlocksCleared):
                # It names no medium (vLLM 0.32). The GPU block pool's reset sends one, and so does that of a
                # SimpleCPUOffloadConnector's CPU block pool, which the same reset call makes after the GPU's:
                # a clear after the batch's first, or after an event of another medium, is the connector's.
                # (The OffloadingConnector's and the Mooncake store's resets send none.)
                if not past_gpu:  # the GPU block pool's: every group's blocks go, those of the batch too
                    grouped = []
                    self._groups.clear(state.bit)
                self._holdings.clear(state, self._offload_tiers if past_gpu else self._gpu_tiers)
                past_gpu = True
        batch.past_gpu, batch.grouped, batch.hybrid = past_gpu, grouped, hybrid
        return taken, parts

    def _stored(
        self, state: OwnerState, pool: PoolState, event: BlockStored, step: int | None
    ) -> Iterator[None] | None:
        """Index a store of blocks that are the owner's own (not a constraining group's); with step, one of
        more blocks than step is left to the steps returned."""
        parts = step if step is not None and len(event.block_hashes) > step else None
        tier = self._tier(event.medium)
        if tier is Tier.POOL:
            steps = self._store_pooled(state, pool, event, parts or _WHOLE)
            if parts:
                return steps
            for _ in steps:
                pass
        elif event.token_ids and (event.medium in _GPU_MEDIA or event.extra_keys is not None):
            if parts:
                return self._store_in_steps(state, tier, event, pool, parts)
            self._store(state, tier, event, pool)
        elif not event.token_ids or self._shaped(event):
            # Without tokens: the OffloadingConnector's default announcement, a key alone. Or an offload
            # announced without its request's extra keys (vLLM 0.32's OffloadingConnector defers them): hashed
            # from its tokens, a salted prompt's or an adapter's block would be another prompt's. Its vLLM
            # hashes are its GPU copies', announced with the keys first.
            if parts:
                store = partial(self._holdings.store_known, state, state, tier, pool=pool)
                return _known_in_steps(store, event.block_hashes, parts)
            self._holdings.store_known(state, state, tier, event.block_hashes, pool)
        return None

    def _removed_in_steps(
        self, owner: OwnerState, tier: Tier, hashes: Sequence[BlockHash], step: int
    ) -> Iterator[None]:
        for start in range(0, len(hashes), step):
            self._holdings.remove(owner, tier, hashes[start : start + step])
            yield

    def _tier(self, medium: str | None) -> Tier:
        return self._medium_tiers.get(medium, Tier.CPU)

    # ---- hybrid models' other groups ----------------------------------------------------------------

    def _hybrid(self, state: OwnerState, events: Sequence[KVEvent]) -> bool:
        """Whether the owner has a full-attention group beside its constraining ones, learnt from its first
        batch that shows one: a model whose only group is a sliding window (or Mamba) has nothing to cut, and
        its blocks are the index's own."""
        if self._groups.anchored(state.bit):
            return True
        if any(
            isinstance(e, BlockStored)
            and e.kv_cache_spec_kind not in CONSTRAINING_KINDS
            and e.kv_cache_spec_kind is not None
            and e.medium in _GPU_MEDIA
            for e in events
        ):
            self._groups.anchor(state.bit)
            return True
        return False

    def _apply_grouped(self, state: OwnerState, events: Sequence[BlockStored | BlockRemoved]) -> None:
        """Constraining groups' stores and removals, in order. A stored block is indexed under the kvroute
        hash of the owner's full-attention block of the same vLLM hash; one it does not hold is an orphan."""
        gpu_blocks = [state.blocks[tier] for tier in self._gpu_tiers]
        for event in events:
            keys = vllm_keys(event.block_hashes)
            if isinstance(event, BlockRemoved):
                self._groups.remove(state.bit, event.group_idx, keys)
                continue
            known = []
            for key in keys:
                packed = next((p for blocks in gpu_blocks if (p := blocks.get(key)) is not None), None)
                if packed is None:
                    self.stats.orphaned += 1
                else:
                    known.append((key, packed >> COUNT_BITS))
            self._groups.store(state.bit, event.group_idx, known)

    def _grouped_in_steps(
        self, state: OwnerState, events: Sequence[BlockStored | BlockRemoved], step: int
    ) -> Iterator[None]:
        """_apply_grouped in parts of about step blocks; an event of more is cut into events of its blocks."""
        part: list[BlockStored | BlockRemoved] = []
        blocks = 0
        for event in events:
            hashes = event.block_hashes
            cut = range(0, len(hashes), step) if len(hashes) > step else ()
            for piece in [replace(event, block_hashes=hashes[i : i + step]) for i in cut] if cut else [event]:
                part.append(piece)
                blocks += len(piece.block_hashes)
                if blocks >= step:
                    self._apply_grouped(state, part)
                    part, blocks = [], 0
                    yield
        if part:
            self._apply_grouped(state, part)

    # ---- stores -------------------------------------------------------------------------------------

    def _store(
        self, state: OwnerState, tier: Tier, event: BlockStored, pool: PoolState, counted: bool = True
    ) -> list[int]:
        """Index the event's blocks for state, whose parent may be in pool; their kvroute hashes, or [] when
        they cannot be indexed. counted=False keeps a block stored twice at one reference."""
        own = self._hashes(state, event, pool)
        if own:
            self._holdings.store(state, tier, vllm_keys(event.block_hashes), own, counted)
        return own

    def _store_in_steps(
        self,
        state: OwnerState,
        tier: Tier,
        event: BlockStored,
        pool: PoolState,
        step: int,
        counted: bool = True,
    ) -> Generator[None, None, list[int]]:
        """_store in steps of step blocks: hashed first (which changes nothing), then entered from the end, as
        Holdings.store enters them, so that nothing of it is reachable before all of it is."""
        size, tokens, extra = self.block_size, event.token_ids, event.extra_keys
        if not self._shaped(event):
            return []
        parent = self._parent(state, event, pool)
        if parent is None:
            return []
        own: list[int] = []
        for start in range(0, len(event.block_hashes), step):
            keys = None if extra is None else extra[start : start + step]
            try:
                own += block_hashing.chain(tokens[start * size : (start + step) * size], size, parent, keys)
            except OverflowError:  # as in _hashes
                self.stats.mismatched += 1
                return []
            parent = own[-1]
            yield
        keys = vllm_keys(event.block_hashes)
        for end in range(len(own), 0, -step):
            start = max(0, end - step)
            self._holdings.store(state, tier, keys[start:end], own[start:end], counted)
            yield
        return own

    def _hashes(self, state: OwnerState, event: BlockStored, pool: PoolState) -> list[int]:
        """The kvroute hashes of the event's blocks, from their tokens along their parent's chain (in state or
        in pool); [] when they cannot be computed, counted as mismatched or orphaned."""
        if not self._shaped(event):
            return []
        parent = self._parent(state, event, pool)
        if parent is None:
            return []
        try:
            return block_hashing.chain(event.token_ids, self.block_size, parent, event.extra_keys)
        except OverflowError:  # kvroute hashes token ids as uint32: one is negative or 2^32 or more
            self.stats.mismatched += 1
            return []

    def _parent(self, state: OwnerState, event: BlockStored, pool: PoolState) -> int | None:
        """The kvroute hash the event's blocks chain from; None, counted as orphaned, when it is unknown."""
        if event.parent_block_hash is None:
            return block_hashing.root_for(event.lora_name)
        packed = self._holdings.find(state, vllm_key(event.parent_block_hash), pool)
        if packed is None:
            self.stats.orphaned += len(event.block_hashes)
            return None
        return packed >> COUNT_BITS

    def _shaped(self, event: BlockStored) -> bool:
        """Whether the event's blocks are the index's: of its block size, with their tokens (and extra keys,
        when sent) one block's worth each. Counted as mismatched when not."""
        count, size, extra = len(event.block_hashes), self.block_size, event.extra_keys
        if (
            event.block_size == size
            and len(event.token_ids) == count * size
            and (extra is None or len(extra) == count)
        ):
            return True
        self.stats.mismatched += 1
        return False

    def _store_pooled(
        self, publisher: OwnerState, pool: PoolState, event: BlockStored, step: int
    ) -> Iterator[None]:
        """A pool write by publisher, entered for its pool name's pseudo-owner; in steps of step blocks
        (_WHOLE: at once)."""
        hashes = event.block_hashes
        if type(hashes[0]) is not bytes:
            self.stats.unkeyed += len(hashes)
            if not self._warned_unkeyed:
                self._warned_unkeyed = True
                log.warning(
                    "pool blocks announced with integer hashes are ignored: their Mooncake keys need "
                    "vLLM's full hashes (run vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)"
                )
            return
        self._pools.join(publisher, pool)
        for unchanged in pool.asked:  # stored again: a lookup begun before this speaks for the old copy only
            unchanged.difference_update(hashes)
        # vLLM's store worker announces pool writes without the request's extra keys (a LoRA adapter's name, a
        # cache salt): hashed from their tokens they would be the base model's plain blocks. The writer's own
        # cache announced them first, with those keys, so its kvroute hashes are taken when it knows them all.
        find, known_all = self._holdings.find, True
        for start in range(0, len(hashes) if event.token_ids else 0, step):
            if not all(find(publisher, vllm_key(h), pool) is not None for h in hashes[start : start + step]):
                known_all = False
                break
            yield
        if not known_all:
            own = yield from self._store_in_steps(pool, Tier.POOL, event, pool, step, False)
            pool.hashes.update(zip(own, cast(list[bytes], hashes), strict=False))  # all of the blocks or none
        else:
            store = partial(self._holdings.store_known, publisher, pool, Tier.POOL, pool=pool, counted=False)
            known = yield from _known_in_steps(store, hashes, step)
            pool.hashes.update(cast(list[tuple[int, bytes]], known))


def _known_in_steps(
    store: Callable[[Sequence[BlockHash]], list[tuple[int, BlockHash]]],
    hashes: Sequence[BlockHash],
    step: int,
) -> Generator[None, None, list[tuple[int, BlockHash]]]:
    """Holdings.store_known (store, all but its hashes given) in steps of step blocks, from the end."""
    known: list[tuple[int, BlockHash]] = []
    for end in range(len(hashes), 0, -step):
        known += store(hashes[max(0, end - step) : end])
        yield
    return known
