"""One simulated vLLM instance, scheduled as vLLM V1's scheduler does (vllm/v1/core/sched/scheduler.py), with
a paged prefix cache that announces KV events and, with a pool, loads of the prefix it finds there.

Each engine step has a budget of max_batched_tokens. The running requests go first, in the order they were
admitted: a decoding one takes one token, a prefilling one the next chunk of its prompt. Blocks are allocated
as the step's tokens need them; when none are free, the request admitted last is preempted (its blocks freed,
its cached ones left in the cache, its progress lost) and waits at the head of the queue to be computed again,
its answer so far included. With budget left and no preemption in the step, waiting requests are admitted in
order while their first chunk's blocks are free. A step lasts the sum of a fixed cost, each decoding request's
share, and its prefill tokens at the prefill rate (plus, with attention costs, what each token's attention to
its context takes). Every full block is cached and announced, those an answer fills included. Steps that only
decode and need no preemption run back to back until the next request finishes or new work arrives, computed
in one event.

In a disaggregated fleet a prefill instance computes a request's prompt as a one-token request (its prefill
leg) and keeps its KV until the decode leg has fetched it; the decode instance admits the decode leg as any
request, fetches the prompt's KV it does not hold over the link (one transfer at a time, as its pool loads),
caches it (announcing it as vLLM does once a transfer is in), computes the last prompt token and decodes.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from fleet.request_queue import Rank, preemption_victim, request_queue
from kvroute.simulate.blocks import TraceBlocks
from kvroute.simulate.clock import EventLoop
from kvroute.simulate.hardware import EngineSpec
from kvroute.simulate.kv_cache import KVCache
from kvroute.simulate.pool import PoolStore, pool_hash
from kvroute.traces import TraceRequest
from router.dispatch.observe.outcome import PdPath
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
    dispatched_s: float = 0.0  # when its router sent it to its instance: its last attempt's start
    admitted_s: float = -1.0  # when the engine took it from its waiting queue
    instance: int = -1
    tried: frozenset[int] = frozenset()  # instances that refused it: its retry goes elsewhere
    uncached_estimate: int = 0  # the router's, for its own bookkeeping
    held: list[int] = field(default_factory=list)  # cached blocks it references
    uncached: int = 0  # blocks it holds that are not cached
    cached_blocks: int = 0  # blocks computed, hit or loaded, and cached
    pool_saved: int = 0  # its prompt's blocks its connector has saved to the pool since admission
    computed: int = 0  # tokens whose KV its instance holds: computed, hit or loaded
    generated: int = 0  # answer tokens given so far
    preempted: int = 0  # how often its instance took its blocks back
    local_hit_blocks: int = 0  # at its first admission
    pool_hit_blocks: int = 0
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
    priority: int = 0  # vLLM's: with the priority scheduling policy, the lowest value runs first
    arrival_s: float = 0.0  # when its instance's queue took it
    warm_up: bool = False  # the router's, not a client's: a program's prompt prefilled while its tool runs
    # Its chain as a router that hashes token ids alone computes it, for a prompt with images (None: chain)
    text_chain: array[int] | None = None

    def token_keys(self) -> array[int]:
        """The keys a router that leaves images out of its hashes computes (vllm-router, SGLang's gateway)."""
        return self.chain if self.text_chain is None else self.text_chain


def warm_up_of(request: SimRequest, instance: int, now: float) -> SimRequest:
    """request's prompt as the router's warm-up sends it to instance: one token, no client's session."""
    traced = replace(request.trace, output_tokens=1, session=None)
    warm = SimRequest(
        request.number, traced, request.chain, None, now, warm_up=True, text_chain=request.text_chain
    )
    warm.instance, warm.dispatched_s = instance, now
    return warm


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
        self.preemptions = 0  # vllm:num_preemptions
        self.on_first_token: Callable[[SimRequest], None] = lambda request: None
        self.on_finish: Callable[[SimRequest], None] = lambda request: None
        self.on_events: Callable[[list[KVEvent]], None] = lambda events: None
        self.on_fetched: Callable[[SimRequest], None] = lambda request: None  # a decode leg has its KV
        self.on_preempted: Callable[[SimRequest], None] = lambda request: None
        # Each step's requests and the tokens each computed (a decode run: each of its steps), as they end.
        self.on_step: Callable[[list[tuple[SimRequest, int]]], None] = lambda scheduled: None
        # Inter-token latencies: each decode step's length, and the tokens it gave (one per request).
        self.itl_s: array[float] = array("d")
        self.itl_tokens: array[int] = array("q")
        self._blocks, self._loop, self._pool, self._load_s = blocks, loop, pool, load_s_per_token
        self._transfer_s = transfer_s_per_token
        self._waiting = request_queue(spec.scheduling_policy, _rank)
        self._admitted = 0  # running, loading its KV, or a prefill leg holding it: what /metrics says runs
        self._running: list[SimRequest] = []  # scheduled each step, in the order they were admitted
        self._pool_events: list[KVEvent] = []
        self._nic_free_s = 0.0
        self._version = 0
        self._stepping = False
        self._run: tuple[float, float, int] = (0.0, 0.0, 0)  # the step under way: start, step, steps
        self._scheduled: list[tuple[SimRequest, int]] = []  # its requests and the tokens each computes

    def load(self) -> EngineLoad:
        """What its /metrics would say now."""
        return EngineLoad(waiting=len(self._waiting), running=self._admitted, kv_usage=self.kv.usage)

    def fits(self, request: TraceRequest) -> bool:
        return self._blocks_of(request.input_tokens + request.output_tokens) <= self.kv.num_blocks

    def enqueue(self, request: SimRequest) -> bool:
        """False: refused, its waiting queue is full (only with EngineSpec.max_waiting; vLLM has no limit)."""
        limit = self.spec.max_waiting
        if limit is not None and len(self._waiting) >= limit:
            return False
        spec = self.spec
        frontend_s = spec.frontend_s + spec.frontend_s_per_token * request.trace.input_tokens
        if frontend_s:
            self._loop.at(self._loop.now + frontend_s, lambda: self._queue(request))
        else:
            self._queue(request)
        return True

    def _queue(self, request: SimRequest) -> None:
        request.arrival_s = self._loop.now
        self._waiting.add(request)
        self._wake()

    def _blocks_of(self, tokens: int) -> int:
        return -(-tokens // self.spec.block_size)

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
        budget, preempted = self.spec.max_batched_tokens, False
        scheduled: list[tuple[SimRequest, int]] = []
        self._scheduled = scheduled
        running, index = self._running, 0
        while index < len(running) and budget > 0:
            request = running[index]
            tokens = min(_tokens(request) - request.computed, budget)
            room, preempted_some = self._make_room(request, request.computed + tokens)
            preempted = preempted or preempted_some
            if not room:
                break
            if preempted_some:  # by priority, whom it preempted may have been scheduled before it
                budget = self.spec.max_batched_tokens - sum(taken for _, taken in scheduled)
                index = running.index(request)
            scheduled.append((request, tokens))
            budget -= tokens
            index += 1
        if not preempted:
            budget = self._admit(budget)
        if not scheduled:
            self._stepping = False
            if preempted and self._waiting:  # the next step admits again, as vLLM's does
                self._loop.at(self._loop.now, self._wake)
            return
        self._stepping = True
        step = self._step_s()
        steps = 1 if preempted or len(scheduled) < len(self._running) else self._decode_run()
        self._schedule_end(self._loop.now, step, steps)

    def _make_room(self, request: SimRequest, tokens: int) -> tuple[bool, bool]:
        """Blocks for request's first `tokens` tokens, preempting while there are too few (the last admitted,
        or by priority the lowest-ranked, fleet/request_queue.py): whether it got them, and whether any
        request was preempted (one this step had scheduled already loses its place in it)."""
        needed = self._blocks_of(tokens) - len(request.held) - request.uncached
        preempted = False
        while needed > self.kv.num_free:
            victim = preemption_victim(self._running, self.spec.scheduling_policy, _rank)
            self._running.remove(victim)
            self._scheduled[:] = [entry for entry in self._scheduled if entry[0] is not victim]
            self._preempt(victim)
            preempted = True
            if victim is request:
                return False, True
        if needed > 0:
            self.kv.allocate(needed)
            request.uncached += needed
        return True, preempted

    def _preempt(self, request: SimRequest) -> None:
        """vLLM's preemption by recompute: its blocks are freed, the cached ones stay in the cache."""
        self._free(request)
        request.computed = request.cached_blocks = 0
        request.preempted += 1
        self.preemptions += 1
        self._admitted -= 1
        self._waiting.prepend(request)
        self.on_preempted(request)

    def _decode_run(self) -> int:
        """How many decode steps can run back to back: until the first request finishes, and while the
        blocks their answers fill are free (else the next step preempts)."""
        scheduled = self._scheduled
        if not all(_decoding(r, tokens) for r, tokens in scheduled):
            return 1
        steps = min(r.trace.output_tokens - r.generated for r, _ in scheduled)
        free = self.kv.num_free

        def blocks_for(count: int) -> int:
            return sum(
                max(self._blocks_of(r.computed + count) - len(r.held) - r.uncached, 0) for r, _ in scheduled
            )

        if blocks_for(steps) > free:
            low, high = 1, steps  # blocks_for(low) fits: this step's were allocated
            while low < high:
                middle = (low + high + 1) // 2
                if blocks_for(middle) <= free:
                    low = middle
                else:
                    high = middle - 1
            steps = low
        for request, _ in scheduled:
            self._make_room(request, request.computed + steps)
        return steps

    def _step_s(self) -> float:
        spec = self.spec
        prefill_tokens, decoding, attention_s, context = 0, 0, 0.0, 0
        for request, tokens in self._scheduled:
            if _decoding(request, tokens):
                decoding += 1
                context += request.computed + 1
            else:
                prefill_tokens += tokens
                attention_s += spec.attention_s(request.computed, tokens)
        # Priced at the contexts' lengths as a decode run starts; the token each step adds is left out (a
        # few percent of contexts this long).
        return (
            spec.decode_step_s
            + spec.decode_step_s_per_seq * decoding
            + spec.decode_s_per_context_token * context
            + prefill_tokens / spec.prefill_tokens_per_s
            + attention_s
        )

    def _end_step(self, version: int) -> None:
        if version != self._version:
            return
        _, step, steps = self._run
        self.busy_s += step * steps
        for _ in range(steps):
            self.on_step(self._scheduled)
        decoding = sum(1 for r, tokens in self._scheduled if _decoding(r, tokens))
        if decoding:
            self.itl_s.append(step)
            self.itl_tokens.append(decoding * steps)
        finished = []
        for request, tokens in self._scheduled:  # a decode run's: one token a step each
            request.computed += tokens * steps
            self._cache_computed(request)
            if request.computed < _tokens(request):
                continue
            request.generated += steps
            if request.first_token_s < 0:
                request.first_token_s = self._loop.now
                self.on_first_token(request)
            if request.generated >= request.trace.output_tokens:
                finished.append(request)
        if finished:
            done = set(map(id, finished))
            self._running = [r for r in self._running if id(r) not in done]
            for request in finished:
                self._finish(request)
        self._flush()
        self._step()

    def _admit(self, budget: int) -> int:
        """Admit waiting requests in order while budget is left and their first chunk's blocks are free;
        returns the budget left."""
        kv, size, spec = self.kv, self.spec.block_size, self.spec
        while self._waiting and budget > 0 and self._admitted < spec.max_num_seqs:
            request = self._waiting.peek()
            first = request.admitted_s < 0
            total = _tokens(request)
            sequence = self._sequence(request, total)
            reusable = min((total - 1) // size, len(sequence))
            hits = kv.cached_prefix(sequence, 0, reusable)
            held = sequence[:hits].tolist()
            fetch = first and request.prefill is not None  # a decode leg: its prompt comes over the link
            pooled = 0
            if not fetch and self._pool is not None:
                pooled = self._pool.prefix(request.chain, hits, min(reusable, len(request.chain)))
            if fetch:
                loaded_to = request.trace.input_tokens
            elif pooled:
                loaded_to = (hits + pooled) * size
            else:
                loaded_to = hits * size + min(total - hits * size, budget)
            new_blocks = self._blocks_of(loaded_to) - hits
            if not kv.can_take(held, new_blocks):
                break
            self._waiting.pop()
            if first:
                request.admitted_s = self._loop.now
                request.local_hit_blocks, request.pool_hit_blocks = hits, pooled
            self._admitted += 1
            kv.touch(held)
            kv.allocate(new_blocks)
            request.held, request.uncached = held, new_blocks
            request.cached_blocks, request.computed = hits, hits * size
            request.pool_saved = 0
            if fetch:  # the whole prompt comes in; the engine computes its last token
                request.transferred_tokens = request.trace.input_tokens - hits * size
                self._transfer(request, request.transferred_tokens * self._transfer_s, loaded_to - 1, True)
            elif pooled:  # the connector loads it before the prefill starts, one transfer at a time
                self._transfer(request, pooled * size * self._load_s, loaded_to, False)
            else:
                self._running.append(request)
                self._scheduled.append((request, loaded_to - request.computed))
                budget -= loaded_to - request.computed
        return budget

    def _sequence(self, request: SimRequest, tokens: int) -> array[int]:
        """The block hashes of request's first `tokens` tokens (and perhaps more): its prompt's chain, or
        with its answer's blocks past the prompt."""
        if tokens < (len(request.chain) + 1) * self.spec.block_size:
            return request.chain
        return self._blocks.sequence(request.number)

    def _transfer(self, request: SimRequest, seconds: float, computed: int, fetched: bool) -> None:
        """Load its first `computed` tokens' KV into its blocks, after the transfers before it: from the
        pool, or (fetched) a decode leg's from its prefill instance."""
        done = max(self._loop.now, self._nic_free_s) + seconds
        self._nic_free_s = done
        self._loop.at(done, lambda: self._loaded(request, computed, fetched))

    def _loaded(self, request: SimRequest, computed: int, fetched: bool) -> None:
        request.computed = computed
        loaded_blocks = min(computed // self.spec.block_size, len(request.chain))
        self._cache_blocks(request, loaded_blocks)
        self._running.append(request)
        self._flush()
        self._wake()
        if fetched:
            self.on_fetched(request)

    def _cache_computed(self, request: SimRequest) -> None:
        full = request.computed // self.spec.block_size
        if full > request.cached_blocks:
            self._cache_blocks(request, full)
        if self._pool is not None:
            self._save_to_pool(request, min(full, len(request.chain)))

    def _cache_blocks(self, request: SimRequest, end: int) -> None:
        start = request.cached_blocks
        size = self.spec.block_size
        chain = self._sequence(request, end * size)
        end = min(end, len(chain))
        if end <= start:
            return
        hashes = chain[start:end].tolist()
        if end <= len(request.chain):
            tokens = self._blocks.tokens(request.trace, start, end)
        else:
            tokens = self._blocks.sequence_tokens(request.number, start, end)
        taken = self.kv.cache(hashes, chain[start - 1] if start else None, tokens)
        request.held += taken
        request.uncached -= len(taken)
        request.cached_blocks = end

    def _save_to_pool(self, request: SimRequest, end: int) -> None:
        """The Mooncake store connector saves a prompt's blocks from its first, those hit in the instance's
        cache included, and skips those the store holds (vLLM 0.32's mooncake/store: a new request's tracker
        starts at 0 saved tokens; the worker drops the keys `batch_is_exist` finds). An answer's blocks are
        not saved (save_decode_cache is off by default)."""
        assert self._pool is not None
        if end <= request.pool_saved:
            return
        prompt = request.chain[request.pool_saved : end].tolist()
        request.pool_saved = end
        if prompt:
            size = self.spec.block_size
            written = self._pool.write(prompt)
            if written:
                self._pool_events.append(
                    BlockStored(
                        block_hashes=[pool_hash(h) for h in written],
                        parent_block_hash=None,
                        token_ids=[],
                        block_size=size,
                        lora_id=None,
                        medium=POOL_MEDIUM,
                        lora_name=None,
                    )
                )

    def _finish(self, request: SimRequest) -> None:
        request.finish_s = self._loop.now
        if request.prefills is None:  # a prefill leg's KV waits for its decode leg (release)
            self._free(request)
        self._admitted -= 1
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


def _tokens(request: SimRequest) -> int:
    """Its prompt and the answer given so far: what a recompute after preemption computes again."""
    return request.trace.input_tokens + request.generated


def _decoding(request: SimRequest, tokens: int) -> bool:
    """Whether its share of a step is one decode token (the last one given, whose KV is computed)."""
    return tokens == 1 and request.generated > 0


def _rank(request: SimRequest) -> Rank:
    """Its place in a queue by priority: vLLM's (priority, arrival_time)."""
    return request.priority, request.arrival_s
