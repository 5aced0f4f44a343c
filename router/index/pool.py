"""Pool credit checked against the Mooncake master before it decides a routing choice.

The pool evicts in the background and tells no one, so the index's pool entries are claims. Before a
decision counts pool blocks, the blocks it would credit are looked up on the master's admin HTTP
(GET /batch_query_keys: metadata only, no lease, not counted as a hit), in concurrent batches, and an
answer is trusted for a short while. Blocks the master does not have leave the index. When the master
cannot be asked, routing goes on without pool credit and kvroute_pool_master_up says so.

Pool keys start with the model's name (its pool name), after the connector's cache_prefix and before its
store namespace when they are set: that start is what the index calls a pool name, so a request's pool credit
is the pool entries of its model's, on the instances serving a model of the same; place_instances tells the
index who is who.

Without a master, the index's matches are taken as they are (IndexOnlyMatches): either way the routing
decision asks a PrefixMatches for them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Protocol

import aiohttp
import msgspec

from router.config import ModelConfig
from router.index.block_index import BlockIndex
from router.metrics import RouterMetrics
from scorers.request import TierMatch

log = logging.getLogger(__name__)

_KEYS_PER_QUERY = 128  # keeps the query string well under common URL limits (about 14 KB)


def pool_key(pool_name: str, vllm_hash: bytes) -> str:
    """The MooncakeStoreConnector's key of a block: tensor/pipeline rank 0, KV cache group 0 (every rank
    writes its own shard, so rank 0's key stands for the block). pool_name is the key's start (key_start)."""
    return f"{pool_name}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{vllm_hash.hex()}"


def key_start(model: ModelConfig) -> str:
    """What model's pool keys start with, as vLLM's PoolKey.build_prefix writes it before the ranks:
    [cache_prefix@]name[store_namespace]; an adapter's blocks are keyed by the engine's model, its base."""
    cache_prefix = f"{model.pool_cache_prefix}@" if model.pool_cache_prefix else ""
    name = model.pool_name or model.lora_of or model.name
    return f"{cache_prefix}{name}{model.pool_store_namespace or ''}"


def pool_names(models: Iterable[ModelConfig]) -> dict[str, str]:
    """Each model's pool name: the start of its pool keys."""
    return {m.name: key_start(m) for m in models}


def place_instances(index: BlockIndex, served: Mapping[str, Sequence[str]], members: Collection[str]) -> None:
    """Give the index each instance's pool name, that of its (first) model, and join the pool members (those
    configured to read the pool). served: each instance's models' pool names, in the order its models are
    listed; an instance listed for models of several pool names runs one of them, and the first is assumed."""
    for instance, names in served.items():
        name, distinct = names[0], set(names)
        if len(distinct) > 1 and instance in members:
            log.warning(
                "instance %s serves models of pool names %s; its pool credit assumes %s (list its models, "
                "or give aliases one pool_name)",
                instance,
                ", ".join(sorted(distinct)),
                name,
            )
        index.set_pool_name(instance, name)
        if instance in members:
            index.join_pool(instance)


class _KeyAnswer(msgspec.Struct):
    ok: bool = False


class _BatchAnswer(msgspec.Struct):
    success: bool
    data: dict[str, _KeyAnswer] = {}


_decode_answer = msgspec.json.Decoder(_BatchAnswer).decode


class PoolUnreachable(Exception):
    """The pool could not say which blocks it holds."""


class PoolLookup(Protocol):
    async def __call__(self, pool_name: str, vllm_hashes: list[bytes]) -> set[bytes]:
        """Those of vllm_hashes whose blocks pool_name's keys hold; PoolUnreachable when it cannot say."""
        ...


class MasterLookup:
    """Asks the Mooncake master's admin HTTP, in concurrent batches."""

    def __init__(self, master_url: str, session: aiohttp.ClientSession, timeout_s: float = 0.2) -> None:
        self._url = master_url.rstrip("/") + "/batch_query_keys"
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def __call__(self, pool_name: str, vllm_hashes: list[bytes]) -> set[bytes]:
        keys = {pool_key(pool_name, h): h for h in vllm_hashes}
        names = list(keys)
        batches = [names[i : i + _KEYS_PER_QUERY] for i in range(0, len(names), _KEYS_PER_QUERY)]
        try:
            answers = await asyncio.gather(*(self._ask(batch) for batch in batches))
        except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError, ValueError) as exc:
            raise PoolUnreachable(repr(exc)) from exc
        return {keys[key] for answer in answers for key, found in answer.items() if found.ok and key in keys}

    async def _ask(self, keys: list[str]) -> dict[str, _KeyAnswer]:
        async with self._session.get(
            self._url, params={"keys": ",".join(keys)}, timeout=self._timeout
        ) as response:
            response.raise_for_status()
            answer = _decode_answer(await response.read())
        if not answer.success:
            raise ValueError("the master could not answer the lookup")
        return answer.data


class PrefixMatches(Protocol):
    """Where a routing decision gets each instance's cached prefix of a request's blocks."""

    async def matches(
        self, model: str, chain: Sequence[int], reusable: int | None = None
    ) -> Mapping[str, TierMatch]:
        """Each instance's match of chain (reusable: as BlockIndex.match), its pool credit as trusted."""
        ...


class IndexOnlyMatches:
    """The index's matches as they are: no Mooncake master to confirm pool credit with."""

    def __init__(self, index: BlockIndex) -> None:
        self._index = index

    async def matches(
        self, model: str, chain: Sequence[int], reusable: int | None = None
    ) -> Mapping[str, TierMatch]:
        return self._index.match(chain, reusable=reusable)


class PoolConfirmer:
    """PrefixMatches whose pool credit the pool confirms first: the Mooncake master (or the simulation's)."""

    def __init__(
        self,
        index: BlockIndex,
        lookup: PoolLookup,
        pool_names: Mapping[str, str],
        metrics: RouterMetrics,
        confirm_ttl_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """lookup: MasterLookup (the simulation asks its own pool). pool_names: each routed model's pool name,
        the start of its pool keys (see pool_names)."""
        self._index = index
        self._lookup = lookup
        self._pool_names = pool_names
        self._metrics = metrics
        self._ttl = confirm_ttl_s
        self._clock = clock
        self._confirmed: dict[tuple[str, bytes], float] = {}  # (model, vLLM hash) -> trusted until, in order

    async def matches(
        self, model: str, chain: Sequence[int], reusable: int | None = None
    ) -> dict[str, TierMatch]:
        """The index's matches of chain (reusable: as BlockIndex.match) with the pool credit of model's pool
        name confirmed: as it is, shortened, or none. Instances of other pool names, which do not serve
        model, keep theirs unconfirmed."""
        matches, own = self._index.match_with_own(chain, reusable)
        name = self._pool_names.get(model, model)
        pool_of = self._index.pool_name
        credited = [instance for instance, m in matches.items() if m.pool and pool_of(instance) == name]
        if not credited:
            return matches
        # An instance's pool credit begins where its own prefix ends, not after all of its own blocks: one
        # evicted from the GPU between blocks still held there or on the CPU is credited to the pool.
        start = min(own[i].gpu + own[i].cpu if i in own else 0 for i in credited)
        end = max(matches[i].gpu + matches[i].cpu + matches[i].pool for i in credited)
        now = self._clock()
        self._expire(now)
        pooled = self._index.pooled(chain, start, end, name)
        unchecked = [h for _, h in pooled if (model, h) not in self._confirmed]
        if not unchecked:
            return matches
        with self._index.asking(unchecked, name) as unchanged:
            try:
                present = await self._lookup(name, unchecked)
            except PoolUnreachable as exc:
                log.debug("Mooncake master not answering, routing without pool credit: %s", exc)
                self._metrics.pool_master_up.set(0)
                self._metrics.pool_lookups("error").inc(len(unchecked))
                return self._index.match(chain, include_pool=False, reusable=reusable)
        self._metrics.pool_master_up.set(1)
        denied = [h for h in unchecked if h not in present]
        until = now + self._ttl
        for vllm_hash in present:
            self._confirmed[model, vllm_hash] = until
        self._metrics.pool_lookups("present").inc(len(present))
        if not denied:
            return matches
        self._metrics.pool_lookups("gone").inc(len(denied))
        # A block announced again while the master was asked is a new copy: the answer is about the old one.
        gone = [h for h in denied if h in unchanged]
        if not gone:
            return matches
        self._index.forget_pooled(gone, name)
        return self._index.match(chain, reusable=reusable)

    def _expire(self, now: float) -> None:
        """Answers are kept in the order they were given, so the expired ones are at the front."""
        confirmed = self._confirmed
        while confirmed:
            key = next(iter(confirmed))
            if confirmed[key] > now:
                break
            del confirmed[key]
