"""One simulated vLLM instance: a waiting queue, continuous batching, chunked prefill, a paged prefix
cache that announces KV events, and, with a pool, loads of the prefix it finds there.

Each engine step decodes one token for every running request and spends up to max_batched_tokens on prefill,
first come first served; it lasts the longer of its prefill (tokens / prefill rate, plus, with attention
costs, what each token's attention to the context before it takes) and its decode step (which grows with the
batch and, with attention costs, with the contexts it reads). Steps with no prefill run back to back until the
next request finishes or new work arrives, computed in one event. A request is admitted when its whole prompt
and answer fit in free blocks (vLLM allocates as it goes and preempts instead; reserving keeps every request's
hits exact).

In a disaggregated fleet a prefill instance computes a request's prompt as a one-token request (its prefill
leg) and keeps its KV until the decode leg has fetched it; the decode instance admits the decode leg as any
request, fetches the prompt's KV it does not hold over the link (one transfer at a time, as its pool loads),
caches it (announcing it as vLLM does once a transfer is in), computes the last prompt token and decodes.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvroute.simulate.blocks import TraceBlocks
from kvroute.simulate.clock import EventLoop
from kvroute.simulate.hardware import EngineSpec
from kvroute.simulate.kv_cache import KVCache
from kvroute.simulate.pool import PoolStore, pool_hash
from kvroute.traces import TraceRequest
from router.dispatch.outcome import PdPath
from router.index.events import BlockStored, KVEvent
from scorers.candidate import EngineLoad

POOL_MEDIUM = "cpu"  # how the MooncakeStoreConnector announces its pool writes


@dataclass(eq=False, slots=True)
class SimRequest:
    number: int
    trace: TraceRequest
    chain: array[int]
    session: str | None
    sent_s: float = 0.0  # when the client sent it: its trace arrival, or its session's previous answer
    admitted_s: float = -1.0  # when the engine took it from its waiting queue
    instance: int = -1
    tried: frozenset[int] = frozenset()  # instances that refused it: its retry goes elsewhere
    uncached_estimate: int = 0  # the router's, for its own bookkeeping
    held: list[int] = field(default_factory=list)  # cached blocks it references
    uncached: int = 0  # blocks it holds that are not cached
    cached_blocks: int = 0  # prompt blocks computed, hit or loaded, and cached
    local_hit_blocks: int = 0
    pool_hit_blocks: int = 0
    prefill_left: int = 0
    decode_left: int = 0
    first_token_s: float = -1.0
    finish_s: float = -1.0
    policy_state: object = None
    router: int = 0  # which of several routers in front of the fleet sent it
    # Disaggregated: a request's prefill leg, whose instance keeps the prompt's KV until the decode leg (the
    # request itself) fetched it; and a prefill leg's request.
    prefill: SimRequest | None = None
    prefills: SimRequest | None = None
    transferred_tokens: int = 0  # fetched from the prefill instance
    path: PdPath | None = None  # how a disaggregated fleet served it
    pending: int = 0  # its uncached tokens its router still counts as queued at its instance
    retire_after_s: float | None = None  # the router stops counting them this long after sending it
    flow: str | None = None  # the flow and objective the router's queue counted it under
    objective: str = "default"
    queued_s: float = 0.0  # how long it waited in the router's queue


class Engine:
    def __init__(
        self,
        number: int,
        spec: EngineSpec,
        blocks: TraceBlocks,
        loop: EventLoop,
        pool: PoolStore | None = None,
        load_s_per_token: float = 0.0,
        transfer_s_per_token: float = 0.0,
    ) -> None:
        self.number = number
        self.spec = spec
        self.kv = KVCache(spec.kv_blocks, spec.block_size)
        self.busy_s = 0.0
        self.on_first_token: Callable[[SimRequest], None] = lambda request: None
        self.on_finish: Callable[[SimRequest], None] = lambda request: None
        self.on_events: Callable[[list[KVEvent]], None] = lambda events: None
        self.on_fetched: Callable[[SimRequest], None] = lambda request: None  # a decode leg has its KV
        # Inter-token latencies: each decode step's length, and the tokens it gave (one per request).
        self.itl_s: array[float] = array("d")
        self.itl_tokens: array[int] = array("q")
        self._blocks, self._loop, self._pool, self._load_s = blocks, loop, pool, load_s_per_token
        self._transfer_s = transfer_s_per_token
        self._waiting: deque[SimRequest] = deque()
        self._running = 0
        self._prefilling: list[SimRequest] = []
        self._decoding: list[SimRequest] = []
        self._pool_events: list[KVEvent] = []
        self._nic_free_s = 0.0
        self._version = 0
        self._stepping = False
        self._run: tuple[float, float, int] = (0.0, 0.0, 0)  # the step under way: start, step, steps
        self._chunks: list[tuple[SimRequest, int]] = []  # its prefill chunks

    def load(self) -> EngineLoad:
        """What its /metrics would say now."""
        return EngineLoad(waiting=len(self._waiting), running=self._running, kv_usage=self.kv.usage)

    def fits(self, request: TraceRequest) -> bool:
        return self._blocks_of(request) <= self.kv.num_blocks

    def enqueue(self, request: SimRequest) -> bool:
        """False: refused, its waiting queue is full."""
        if len(self._waiting) >= self.spec.max_waiting:
            return False
        self._waiting.append(request)
        self._wake()
        return True

    def _blocks_of(self, request: TraceRequest) -> int:
        return -(-(request.input_tokens + request.output_tokens) // self.spec.block_size)

    def _wake(self) -> None:
        if not self._stepping:
            self._step()
            return
        start, step, steps = self._run
        if steps > 1:  # cut a decode run short: new work joins at the end of the step under way
            done = min(int((self._loop.now - start) / step) + 1, steps)
            if done < steps:
                self._schedule_end(start, step, done)

    def _schedule_end(self, start: float, step: float, steps: int) -> None:
        self._version += 1
        version = self._version
        self._run = (start, step, steps)
        self._loop.at(start + step * steps, lambda: self._end_step(version))

    def _step(self) -> None:
        self._admit()
        now, spec = self._loop.now, self.spec
        budget, prefill_tokens, attention_s = spec.max_batched_tokens, 0, 0.0
        self._chunks = []
        for request in self._prefilling:
            if budget <= 0:
                break
            chunk = min(request.prefill_left, budget)
            self._chunks.append((request, chunk))
            budget -= chunk
            prefill_tokens += chunk
            attention_s += spec.attention_s(request.trace.input_tokens - request.prefill_left, chunk)
        decoding = len(self._decoding)
        if not prefill_tokens and not decoding:
            self._stepping = False
            return
        self._stepping = True
        decode_s = spec.decode_step_s + spec.decode_step_s_per_seq * decoding if decoding else 0.0
        if decoding and spec.decode_s_per_context_token:
            # Priced at the contexts' lengths as the run starts; the token each step adds is left out (a few
            # percent of contexts this long).
            decode_s += spec.decode_s_per_context_token * sum(
                r.trace.input_tokens + r.trace.output_tokens - r.decode_left for r in self._decoding
            )
        if prefill_tokens:
            self._schedule_end(
                now, max(prefill_tokens / spec.prefill_tokens_per_s + attention_s, decode_s), 1
            )
        else:
            self._schedule_end(now, decode_s, min(r.decode_left for r in self._decoding))

    def _end_step(self, version: int) -> None:
        if version != self._version:
            return
        _, step, steps = self._run
        self.busy_s += step * steps
        if self._decoding:
            self.itl_s.append(step)
            self.itl_tokens.append(len(self._decoding) * steps)
        finished = []
        for request in self._decoding:
            request.decode_left -= steps
            if request.decode_left <= 0:
                finished.append(request)
        started = []
        for request, chunk in self._chunks:
            request.prefill_left -= chunk
            self._cache_computed(request)
            if request.prefill_left == 0:
                started.append(request)
        if started:
            self._prefilling = [r for r in self._prefilling if r.prefill_left > 0]
        for request in finished:
            self._finish(request)
        if finished:
            self._decoding = [r for r in self._decoding if r.decode_left > 0]
        for request in started:
            request.first_token_s = self._loop.now
            request.decode_left = request.trace.output_tokens - 1
            self.on_first_token(request)
            if request.decode_left > 0:
                self._decoding.append(request)
            else:
                self._finish(request)
        self._flush()
        self._step()

    def _admit(self) -> None:
        kv, size, spec = self.kv, self.spec.block_size, self.spec
        while self._waiting and self._running < spec.max_num_seqs:
            request = self._waiting[0]
            chain = request.chain
            reusable = min((request.trace.input_tokens - 1) // size, len(chain))
            hits = kv.cached_prefix(chain, 0, reusable)
            new_blocks = self._blocks_of(request.trace) - hits
            held = chain[:hits].tolist()
            if not kv.can_take(held, new_blocks):
                break
            self._waiting.popleft()
            request.admitted_s = self._loop.now
            self._running += 1
            kv.touch(held)
            kv.allocate(new_blocks)
            request.held, request.uncached = held, new_blocks
            request.cached_blocks = request.local_hit_blocks = hits
            if request.prefill is not None:  # the decode leg: the rest comes from the prefill instance
                request.transferred_tokens = request.trace.input_tokens - hits * size
                self._transfer(request, request.transferred_tokens * self._transfer_s)
                continue
            pooled = self._pool.prefix(chain, hits, reusable) if self._pool is not None else 0
            request.pool_hit_blocks = pooled
            if pooled:  # the connector loads it before the prefill starts, one transfer at a time
                self._transfer(request, pooled * size * self._load_s)
            else:
                request.prefill_left = request.trace.input_tokens - hits * size
                self._prefilling.append(request)

    def _transfer(self, request: SimRequest, seconds: float) -> None:
        """Load into its blocks, after the transfers before it: from the pool, or a decode leg's KV."""
        done = max(self._loop.now, self._nic_free_s) + seconds
        self._nic_free_s = done
        self._loop.at(done, lambda: self._loaded(request))

    def _loaded(self, request: SimRequest) -> None:
        size = self.spec.block_size
        if request.prefill is None:
            done = request.local_hit_blocks + request.pool_hit_blocks
            request.prefill_left = request.trace.input_tokens - done * size
        else:  # the whole prompt is in; the engine computes its last token
            done = min((request.trace.input_tokens - 1) // size, len(request.chain))
            request.prefill_left = 1
        self._cache_blocks(request, done, write_pool=False)
        self._prefilling.append(request)
        self._flush()
        self._wake()
        if request.prefill is not None:
            self.on_fetched(request)

    def _cache_computed(self, request: SimRequest) -> None:
        computed = request.trace.input_tokens - request.prefill_left
        full = min(computed // self.spec.block_size, len(request.chain))
        if full > request.cached_blocks:
            self._cache_blocks(request, full, write_pool=True)

    def _cache_blocks(self, request: SimRequest, end: int, write_pool: bool) -> None:
        start, chain = request.cached_blocks, request.chain
        hashes = chain[start:end].tolist()
        tokens = self._blocks.tokens(request.trace, start, end)
        taken = self.kv.cache(hashes, chain[start - 1] if start else None, tokens)
        request.held += taken
        request.uncached -= len(taken)
        request.cached_blocks = end
        if write_pool and self._pool is not None:
            written = self._pool.write(hashes)
            if written:
                self._pool_events.append(
                    BlockStored(
                        block_hashes=[pool_hash(h) for h in written],
                        parent_block_hash=None,
                        token_ids=[],
                        block_size=self.spec.block_size,
                        lora_id=None,
                        medium=POOL_MEDIUM,
                        lora_name=None,
                    )
                )

    def _finish(self, request: SimRequest) -> None:
        request.finish_s = self._loop.now
        if request.prefills is None:  # a prefill leg's KV waits for its decode leg (release)
            self._free(request)
        self._running -= 1
        self.on_finish(request)

    def release(self, request: SimRequest) -> None:
        """A prefill leg's KV was fetched, or will not be: free it."""
        self._free(request)
        self._wake()

    def _free(self, request: SimRequest) -> None:
        self.kv.free(request.held, request.uncached)
        request.held, request.uncached = [], 0

    def _flush(self) -> None:
        events = self.kv.take_events()
        if self._pool_events:
            events += self._pool_events
            self._pool_events = []
        if events:
            self.on_events(events)
