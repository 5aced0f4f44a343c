"""Other routers' published algorithms with their default parameters (shared/reference/peers.md).

Each reads only what that router can know: its own in-flight counts, its own routing history, or an index
fed by KV events (kvroute's BlockIndex, which holds the same facts as theirs), never the engines' state.
"""

from __future__ import annotations

import bisect
import math
import random
import zlib
from collections.abc import Sequence

from kvroute.simulate.engine import SimRequest
from kvroute.simulate.policies import SIM_OBJECTIVES, SimPolicy
from kvroute.simulate.view import RouterView
from router.dispatch.intake.engine_priority import engine_priority
from scorers.request import NO_MATCH


def _least_loaded(loads: Sequence[float], rng: random.Random) -> int:
    low = min(loads)
    return rng.choice([i for i, load in enumerate(loads) if load == low])


class ConsistentHash(SimPolicy):
    """vllm-router `consistent_hash`: a hash ring of workers, each at `virtual_nodes` points (160, as
    ketama); a request goes to the first point clockwise of its session key's hash."""

    name = "consistent-hash"

    def __init__(self, virtual_nodes: int = 160) -> None:
        self._virtual_nodes = virtual_nodes

    def bind(self, view: RouterView) -> None:
        super().bind(view)
        ring = sorted(
            (zlib.crc32(f"{instance.name}#{v}".encode()), number)
            for number, instance in enumerate(view.instances)
            for v in range(self._virtual_nodes)
        )
        self._points = [point for point, _ in ring]
        self._owners = [owner for _, owner in ring]

    def route(self, request: SimRequest) -> int:
        key = zlib.crc32((request.session or str(request.number)).encode())
        position = bisect.bisect(self._points, key)
        for step in range(len(self._points)):  # the next owner on the ring that has not refused it
            owner = self._owners[(position + step) % len(self._points)]
            if owner not in request.tried:
                return owner
        return self._owners[position % len(self._points)]


class PowerOfTwo(SimPolicy):
    """vllm-router `power_of_two`: two distinct workers at random, the one with fewer requests in flight."""

    name = "power-of-two"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def route(self, request: SimRequest) -> int:
        instances = self.view.instances
        untried = [n for n in range(len(instances)) if n not in request.tried] or [0]
        first, second = self._rng.sample(untried, 2) if len(untried) > 1 else (untried[0], untried[0])
        return first if instances[first].in_flight <= instances[second].in_flight else second


class CacheAwareTrees:
    """SGLang model gateway `cache_aware`'s choice among some workers (engine numbers), given their loads:
    an approximate radix tree per worker of the prompts routed there, LRU-trimmed to max_tree_size every
    eviction_interval_s (120 s).

    Imbalanced (max - min load > balance_abs_threshold 64 and max > balance_rel_threshold 1.5 x min): the
    least loaded worker. Otherwise the worker with the longest match if it covers more than cache_threshold
    (0.3) of the prompt, else the least loaded. The chosen worker's tree gets the prompt. The tree is over
    tokens (as vllm-router 0.1.17 keys it; SGLang's over characters), kept per block of 16 tokens by its
    chained hash, which names the whole prefix up to it just as a path in a radix tree does. Workers tied at
    the longest match are drawn at random; vllm-router 0.1.17 takes the least loaded of them instead, and its
    tree holds 2^25 characters of hex-encoded tokens (about 4M tokens).
    """

    def __init__(
        self,
        workers: Sequence[int],
        block_size: int,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        eviction_interval_s: float = 120.0,
        max_tree_size: int = 2**26,
        seed: int = 0,
    ) -> None:
        self._workers, self._block_size = list(workers), block_size
        self._threshold, self._abs, self._rel = cache_threshold, balance_abs_threshold, balance_rel_threshold
        self._interval, self._max_tokens = eviction_interval_s, max_tree_size
        self._rng = random.Random(seed)
        self._next_eviction = eviction_interval_s
        self._trees: list[dict[int, float]] = [{} for _ in self._workers]  # block hash -> last routed

    def choose(self, request: SimRequest, loads: Sequence[int], now: float) -> int:
        """The engine number for request; loads: the workers', in their order. Workers that refused it
        (request.tried) are left out, as a retry leaves out the worker that failed."""
        if now >= self._next_eviction:
            self._evict()
            self._next_eviction = now + self._interval
        chain = request.token_keys()  # SGLang's gateway hashes no images into its tree
        allowed = [i for i, w in enumerate(self._workers) if w not in request.tried] or [0]
        loads = [loads[i] for i in allowed]
        if max(loads) - min(loads) > self._abs and max(loads) > self._rel * min(loads):
            chosen = allowed[_least_loaded(loads, self._rng)]
        else:
            matched = [self._matched(self._trees[i], chain) for i in allowed]
            best = max(matched)
            ratio = best * self._block_size / request.trace.input_tokens
            if ratio > self._threshold:
                chosen = self._rng.choice([allowed[i] for i, m in enumerate(matched) if m == best])
            else:
                chosen = allowed[_least_loaded(loads, self._rng)]
        tree = self._trees[chosen]
        for block_hash in chain:
            tree[block_hash] = now
        return self._workers[chosen]

    @staticmethod
    def _matched(tree: dict[int, float], chain: Sequence[int]) -> int:
        count = 0
        for block_hash in chain:
            if block_hash not in tree:
                break
            count += 1
        return count

    def _evict(self) -> None:
        limit = self._max_tokens // self._block_size
        for number, tree in enumerate(self._trees):
            if len(tree) > limit:  # a prefix is routed whenever its extensions are: oldest are leaves
                kept = sorted(tree.items(), key=lambda item: item[1])[len(tree) - limit :]
                self._trees[number] = dict(kept)


class SGLangCacheAware(SimPolicy):
    """SGLang model gateway `cache_aware` (also vllm-router's default) over every worker, loaded by the
    requests it has in flight on each (CacheAwareTrees)."""

    name = "sglang-cache-aware"

    def bind(self, view: RouterView) -> None:
        super().bind(view)
        self._trees = CacheAwareTrees(range(len(view.instances)), view.block_size)

    def route(self, request: SimRequest) -> int:
        loads = [instance.in_flight for instance in self.view.instances]
        return self._trees.choose(request, loads, self.view.loop.now)


class ActiveWork:
    """A router's own count, per worker, of prefill tokens not yet answered and KV blocks in flight. With
    assume_kv_reuse (Dynamo's default, router_assume_kv_reuse) a block shared by requests in flight on a
    worker counts once there: the blocks are the distinct hashes in flight, each with its requests' count."""

    def __init__(self, workers: int, assume_kv_reuse: bool) -> None:
        self.prefill_tokens = [0] * workers
        self.blocks = [0] * workers
        self._reuse = assume_kv_reuse
        self._hashes: list[dict[int, int]] = [{} for _ in range(workers)]

    def decode_blocks(self, worker: int, chain: Sequence[int], prompt_blocks: int) -> int:
        """The worker's blocks in flight if this prompt went there too."""
        if not self._reuse:
            return self.blocks[worker] + prompt_blocks
        active = self._hashes[worker]
        partial = prompt_blocks - len(chain)  # the last, partial block has no hash: never shared
        return self.blocks[worker] + sum(1 for h in chain if h not in active) + partial

    def add(self, worker: int, chain: Sequence[int], prompt_blocks: int) -> None:
        self.blocks[worker] = self.decode_blocks(worker, chain, prompt_blocks)
        if self._reuse:
            active = self._hashes[worker]
            for h in chain:
                active[h] = active.get(h, 0) + 1

    def remove(self, worker: int, chain: Sequence[int], prompt_blocks: int) -> None:
        if not self._reuse:
            self.blocks[worker] -= prompt_blocks
            return
        active, freed = self._hashes[worker], prompt_blocks - len(chain)
        for h in chain:
            count = active[h] - 1
            if count:
                active[h] = count
            else:
                del active[h]
                freed += 1
        self.blocks[worker] -= freed


class DynamoCost(SimPolicy):
    """NVIDIA Dynamo's KV router: the lowest

        cost = prefill_load_scale x max(active prefill blocks + prompt blocks - overlap credit, 0)
             + decode blocks

    with prefill_load_scale 1.0 and overlap credit per matched block by tier: GPU 1.0, host 0.75, disk 0.25
    (the shared pool is credited as disk, its slowest tier), times overlap_weight (1.0), temperature 0 (ties
    at random). Active prefill and decode blocks are its own bookkeeping of the requests it routed, decode
    blocks with router_assume_kv_reuse on (its default): blocks shared by requests in flight on a worker
    count once, and a new request adds only its blocks not already there. No speculative entries. workers:
    the engine numbers it chooses among (None: all).
    """

    name = "dynamo"
    credits = (1.0, 0.75, 0.25)

    def __init__(
        self,
        prefill_load_scale: float = 1.0,
        seed: int = 0,
        overlap_weight: float = 1.0,
        assume_kv_reuse: bool = True,
        workers: Sequence[int] | None = None,
    ) -> None:
        self._scale, self._overlap, self._reuse = prefill_load_scale, overlap_weight, assume_kv_reuse
        self._rng = random.Random(seed)
        self._workers = workers

    def bind(self, view: RouterView) -> None:
        super().bind(view)
        self._active = ActiveWork(len(view.instances), assume_kv_reuse=self._reuse)
        if self._workers is None:
            self._workers = range(len(view.instances))

    def route(self, request: SimRequest) -> int:
        view, active, size = self.view, self._active, self.view.block_size
        workers = self._workers
        assert workers is not None
        chain = request.chain.tolist()
        matches = view.matches(chain)
        prompt_blocks = -(-request.trace.input_tokens // size)
        gpu, cpu, pool = (self._overlap * credit for credit in self.credits)
        workers = [number for number in workers if number not in request.tried] or list(workers)
        costs = []
        for number in workers:
            match = matches.get(view.instances[number].name, NO_MATCH)
            credit = gpu * match.gpu + cpu * match.cpu + pool * match.pool
            prefill = active.prefill_tokens[number] / size + prompt_blocks - credit
            decode = active.decode_blocks(number, chain, prompt_blocks)
            costs.append(self._scale * max(prefill, 0.0) + decode)
        chosen = workers[_least_loaded(costs, self._rng)]
        match = matches.get(view.instances[chosen].name, NO_MATCH)
        request.uncached_estimate = max(request.trace.input_tokens - match.gpu * size, 0)
        active.prefill_tokens[chosen] += request.uncached_estimate
        active.add(chosen, chain, prompt_blocks)
        return chosen

    def engine_priority(self, request: SimRequest) -> int:
        """Dynamo passes a request's priority to vLLM, lowest first (reference/peers.md)."""
        return engine_priority(SIM_OBJECTIVES.get(request.trace.objective or "", {}).get("priority", 0))

    def first_token(self, request: SimRequest) -> None:
        self._active.prefill_tokens[request.instance] -= request.uncached_estimate

    def finished(self, request: SimRequest) -> None:
        prompt_blocks = -(-request.trace.input_tokens // self.view.block_size)
        self._active.remove(request.instance, request.chain.tolist(), prompt_blocks)

    def refused(self, request: SimRequest) -> None:
        self.first_token(request)
        self.finished(request)


class VllmRouterKvAware(SimPolicy):
    """vllm-router `kv_aware` as its 0.1.17 source has it (the binary the live benchmark runs): the lowest

        cost = (new prefill tokens + active prefill tokens) x (requests in flight + 1)

    first worker on ties (temperature 0). New prefill tokens are the prompt's length less its credited
    prefix: the worker's GPU prefix from block 0, at most the blocks before the last prompt token, then one
    run of host blocks at 0.8, the whole capped at the prompt's length - 1. Active prefill tokens are its
    own count of the new tokens it routed there that have not reached their first token. No speculative
    entries, no other rule on a miss.

    Shared-pool blocks count in 0.1.17 only for the worker whose connector announced them (as host or
    external), which the simulation's index does not record: the pool credits nobody here. Earlier versions
    of this class followed shared/reference/peers.md (Dynamo's cost, speculation, least loaded on a miss),
    which the 0.1.17 source contradicts.
    """

    name = "vllm-router-kv-aware"
    host_credit = 0.8

    def bind(self, view: RouterView) -> None:
        super().bind(view)
        self._active_prefill = [0] * len(view.instances)

    def route(self, request: SimRequest) -> int:
        new_tokens = self.new_prefill_tokens(request)
        costs = [
            math.inf  # a retry goes elsewhere
            if number in request.tried
            else (new + self._active_prefill[number]) * (instance.in_flight + 1)
            for number, (new, instance) in enumerate(zip(new_tokens, self.view.instances, strict=True))
        ]
        chosen = costs.index(min(costs))
        return self.place(request, chosen, new_tokens[chosen])

    def new_prefill_tokens(self, request: SimRequest) -> list[int]:
        """Each worker's new prefill tokens for request: its length less the prefix credited there."""
        view, size = self.view, self.view.block_size
        length = request.trace.input_tokens
        reusable = max(length - 1, 0)  # the last prompt token is always computed
        # vllm-router hashes the prompt's token ids alone: past an image it matches no engine key
        matches = view.matches(request.token_keys().tolist(), include_pool=False)
        new_tokens = []
        for instance in view.instances:
            match = matches.get(instance.name, NO_MATCH)
            device = min(match.gpu, reusable // size)
            credit = min((device + self.host_credit * match.cpu) * size, reusable)
            new_tokens.append(math.ceil(length - credit))
        return new_tokens

    def place(self, request: SimRequest, chosen: int, new_tokens: int) -> int:
        """Reserve request's new prefill tokens on chosen, as its slot does until the first output."""
        request.uncached_estimate = new_tokens
        self._active_prefill[chosen] += new_tokens
        return chosen

    def first_token(self, request: SimRequest) -> None:
        self._active_prefill[request.instance] -= request.uncached_estimate

    def refused(self, request: SimRequest) -> None:
        self.first_token(request)
