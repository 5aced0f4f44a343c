"""A simulated vLLM engine: a waiting queue, continuous batching and real time spent per step.

Each step decodes one token for every running sequence and spends the rest of a token budget on prefill
(chunked, first come first served). A step lasts prefill_tokens / prefill rate + one decode time, so a prompt
costs time in proportion to its uncached tokens. KV blocks are allocated as sequences grow; when none is free
the newest running request (by priority: the lowest-ranked) is preempted and recomputed later, as vLLM does.
The waiting queue is in arrival order, or with the priority policy by each request's `priority`
(fleet/request_queue.py).

A decode leg's prompt KV comes from a prefill instance: admitted, it holds its blocks and waits (counted as
waiting) until the load ends, then runs with its whole prompt in place, or computes what the load did not
bring (kv_load_failure_policy recompute). The prefix-cache counters move as vLLM's scheduler moves them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from fleet.block_pool import Adapter, Block, BlockHasher, BlockPool, NoFreeBlocks
from fleet.request_queue import Rank, SchedulingPolicy, preemption_victim, request_queue
from router.index.events import KVEvent
from router.prompt.multimodal.block_keys import Placed


@dataclass(frozen=True, slots=True)
class EngineTiming:
    prefill_tokens_per_s: float = 8000.0
    decode_s_per_token: float = 0.01
    max_num_seqs: int = 16
    max_batched_tokens: int = 2048
    transfer_tokens_per_s: float = 100_000.0  # KV fetched from a prefill instance (fleet/kv_transfer.py)
    scheduling_policy: SchedulingPolicy = "fcfs"  # vLLM's --scheduling-policy


@dataclass(slots=True)
class EngineStats:
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # by vLLM's finished_reason
    preemptions: int = 0
    external_prefix_cache_queries: int = 0  # prompt tokens looked up beyond the local cache: decode legs'
    external_prefix_cache_hits: int = 0  # of those, fetched from a prefill instance
    # vllm:prompt_tokens_by_source: local_compute + local_cache_hit + external_kv_transfer = prompt_tokens
    prompt_tokens_by_source: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("local_compute", "local_cache_hit", "external_kv_transfer"), 0)
    )


@dataclass(slots=True)
class PromptCache:
    """What one request's prompt found cached and what it added to the prefix cache, known at its first
    token, as vLLM counts them for usage.prompt_tokens_details (PrefillStats at the first scheduling, and
    finalize at the first output)."""

    cached_tokens: int = 0  # from the local prefix cache, or loaded by the KV connector
    created_tokens: int = 0  # the tokens of the prompt's full blocks now cached, less those


TokenSampler = Callable[[int], int]
"""Maps an output position to the token id generated there."""

KVLoad = Callable[[], Awaitable[bool]]
"""Brings a prompt's KV from a prefill instance (fleet/kv_transfer.py); False when it could not."""


@dataclass(eq=False)
class _Sequence:
    token_ids: list[int]
    num_prompt_tokens: int
    max_tokens: int
    sample: TokenSampler
    block_hashes: list[bytes]
    cache_salt: str | None = None
    images: tuple[Placed, ...] = ()  # the prompt's images, placed in it
    lora: Adapter | None = None
    outputs: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    blocks: list[Block] = field(default_factory=list)
    num_computed: int = 0
    num_cached_blocks: int = 0
    num_output: int = 0
    finish_reason: str = "length"  # vLLM's finished_reason when it has its max_tokens: stop, at a sampled EOS
    connector: bool = False  # the engine runs a KV connector, asked about every prompt's uncached tokens
    load: KVLoad | None = None  # until it ends: the prompt's KV beyond the local cache comes from elsewhere
    loading: asyncio.Task[None] | None = None
    cache: PromptCache = field(default_factory=PromptCache)
    preempted: bool = False
    priority: int = 0  # vLLM's: by the priority policy, the lowest value first
    arrival_s: float = 0.0

    @property
    def prefilling(self) -> bool:
        """Prompt (or, after preemption, prompt and output) tokens are still to be computed."""
        return len(self.token_ids) - self.num_computed > 1 or self.num_output == 0


class Engine:
    def __init__(
        self,
        pool: BlockPool,
        timing: EngineTiming,
        hasher: BlockHasher,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.pool = pool
        self.timing = timing
        self.stats = EngineStats()
        self.hasher = hasher
        self._waiting = request_queue(timing.scheduling_policy, _rank)
        self._running: list[_Sequence] = []
        self._loading: set[_Sequence] = set()  # vLLM's WAITING_FOR_REMOTE_KVS: blocks held, counted waiting
        self._wake = asyncio.Event()
        self._sleep = sleep
        self._publish: Callable[[list[KVEvent]], None] = lambda events: None

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._loading)

    def on_events(self, publish: Callable[[list[KVEvent]], None]) -> None:
        self._publish = publish

    async def generate(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sample: TokenSampler,
        cache_salt: str | None = None,
        lora: Adapter | None = None,
        connector: bool = False,
        load: KVLoad | None = None,
        cache: PromptCache | None = None,
        finish_reason: str = "length",
        priority: int = 0,
        images: Sequence[Placed] = (),
    ) -> AsyncIterator[int]:
        """Yield generated token ids; cancelling the consumer aborts the request and frees its blocks.
        cache_salt: vLLM's, which makes the prompt's cache entries its own; lora: the adapter it runs with,
        whose cache entries are its own too; connector: the instance runs a KV connector; load: brings the
        prompt's KV beyond the local cache from a prefill instance (a decode leg), run once the request is
        admitted; the transfer then takes transfer_tokens_per_s; cache: filled in by the first token;
        finish_reason: what it finishes as once it has max_tokens (stop: the model sampled its EOS);
        priority: the body's, which orders the queue under the priority policy; images: the prompt's, each
        keying the blocks it overlaps."""
        seq = _Sequence(
            token_ids=list(prompt_ids),
            num_prompt_tokens=len(prompt_ids),
            max_tokens=max_tokens,
            sample=sample,
            block_hashes=self.hasher.chain(
                prompt_ids, self.pool.block_size, salt=cache_salt, lora=lora, items=images
            ),
            cache_salt=cache_salt,
            images=tuple(images),
            lora=lora,
            connector=connector,
            load=load,
            cache=cache or PromptCache(),
            finish_reason=finish_reason,
            priority=priority,
            arrival_s=asyncio.get_running_loop().time(),
        )
        self._waiting.add(seq)
        self._wake.set()
        finished = False
        try:
            while (token := await seq.outputs.get()) is not None:
                yield token
            finished = True
        finally:
            if not finished:
                self._abort(seq)

    def reset_prefix_cache(self) -> bool:
        """As in vLLM, the AllBlocksCleared event goes out with the next engine step's batch."""
        return self.pool.reset()

    async def run(self) -> None:
        while True:
            prefill_tokens, scheduled = self._schedule()
            if not scheduled:  # idle, or what waits needs blocks that loads hold: until that changes
                self._flush_events()
                self._wake.clear()
                await self._wake.wait()
                continue
            decode_time = (
                self.timing.decode_s_per_token if any(not seq.prefilling for seq in scheduled) else 0.0
            )
            await self._sleep(prefill_tokens / self.timing.prefill_tokens_per_s + decode_time)
            self._advance(scheduled)
            self._flush_events()

    def _schedule(self) -> tuple[int, dict[_Sequence, int]]:
        budget = self.timing.max_batched_tokens
        scheduled: dict[_Sequence, int] = {}
        prefill_tokens = 0
        prefilling: set[_Sequence] = set()
        for seq in list(self._running):
            if seq not in self._running:  # preempted while making room for another
                continue
            wanted = min(len(seq.token_ids) - seq.num_computed, budget)
            if wanted <= 0 or not self._reserve(seq, seq.num_computed + wanted):
                continue
            # By priority, whom it preempted may have been scheduled already this step.
            for preempted in [s for s in scheduled if s not in self._running]:
                tokens = scheduled.pop(preempted)
                budget += tokens
                prefill_tokens -= tokens if preempted in prefilling else 0
            scheduled[seq] = wanted
            budget -= wanted
            if seq.prefilling:
                prefilling.add(seq)
                prefill_tokens += wanted
        while self._waiting and budget > 0 and len(self._running) < self.timing.max_num_seqs:
            seq = self._waiting.peek()
            if not seq.blocks and self._admit(seq) is None:  # a loaded one holds its blocks already
                break
            self._waiting.pop()
            if seq.load is not None:
                self._loading.add(seq)
                seq.loading = asyncio.create_task(self._load(seq, seq.load))
                continue
            self._running.append(seq)
            wanted = min(len(seq.token_ids) - seq.num_computed, budget)
            scheduled[seq] = wanted
            budget -= wanted
            prefill_tokens += wanted
        return prefill_tokens, scheduled

    def _admit(self, seq: _Sequence) -> int | None:
        """Take the cached prefix and allocate the rest of the prompt; None when the cache is full."""
        # vLLM recomputes at least the last prompt token to get logits.
        max_hit_blocks = (len(seq.token_ids) - 1) // self.pool.block_size
        hits = self.pool.cached_prefix(seq.block_hashes[:max_hit_blocks])
        needed = -(-len(seq.token_ids) // self.pool.block_size) - len(hits)
        if needed > self.pool.num_free - sum(1 for b in hits if b.ref_cnt == 0):
            return None
        self.pool.touch(hits)
        seq.blocks = hits + self.pool.allocate(needed)
        seq.num_computed = len(hits) * self.pool.block_size
        seq.num_cached_blocks = len(hits)
        if not seq.preempted:  # a planned load counts, whatever becomes of it
            loaded = len(seq.token_ids) - seq.num_computed if seq.load is not None else 0
            seq.cache.cached_tokens = seq.num_computed + loaded
        if seq.num_output == 0:  # a preempted request is not queried twice
            stats, uncached = self.stats, len(seq.token_ids) - seq.num_computed
            stats.prefix_cache_queries += len(seq.token_ids)
            stats.prefix_cache_hits += seq.num_computed
            if seq.connector:
                stats.external_prefix_cache_queries += uncached
                # A planned load counts as a hit at once, whatever becomes of it.
                stats.external_prefix_cache_hits += uncached if seq.load is not None else 0
            if seq.load is None:
                self._count_sources(seq.num_computed, 0, uncached)
        return len(hits)

    async def _load(self, seq: _Sequence, load: KVLoad) -> None:
        """Wait for an admitted sequence's KV, then queue it to run: its prompt in place, or (the load
        failed) what its local cache held, or (it held nothing) looked up again from the start."""
        local, uncached = seq.num_computed, len(seq.token_ids) - seq.num_computed
        loaded = await load()
        if loaded:
            await self._sleep(uncached / self.timing.transfer_tokens_per_s)
        self._loading.discard(seq)
        seq.load = seq.loading = None
        if loaded:
            self._count_sources(local, uncached, 0)
            seq.num_computed = len(seq.token_ids)
        elif local:
            self._count_sources(local, 0, uncached)
        else:
            self.pool.free(seq.blocks)
            seq.blocks = []
        self._waiting.prepend(seq)
        self._wake.set()

    def _count_sources(self, local_cache_hit: int, external_kv_transfer: int, local_compute: int) -> None:
        """A prompt about to be computed, by where its tokens come from. vLLM counts them with the first
        token: a request aborted while it waits, never."""
        self.stats.prompt_tokens += local_cache_hit + external_kv_transfer + local_compute
        sources = self.stats.prompt_tokens_by_source
        sources["local_cache_hit"] += local_cache_hit
        sources["external_kv_transfer"] += external_kv_transfer
        sources["local_compute"] += local_compute

    def _reserve(self, seq: _Sequence, num_tokens: int) -> bool:
        """Grow seq's blocks to hold num_tokens, preempting others (or itself) if needed."""
        needed = -(-num_tokens // self.pool.block_size) - len(seq.blocks)
        while needed > 0:
            try:
                seq.blocks += self.pool.allocate(needed)
                return True
            except NoFreeBlocks:
                victim = preemption_victim(self._running, self.timing.scheduling_policy, _rank)
                self._preempt(victim)
                if victim is seq:
                    return False
        return True

    def _preempt(self, seq: _Sequence) -> None:
        self._running.remove(seq)
        self.pool.free(seq.blocks)
        seq.blocks, seq.num_computed, seq.num_cached_blocks = [], 0, 0
        seq.preempted = True
        self._waiting.prepend(seq)
        self.stats.preemptions += 1

    def _advance(self, scheduled: dict[_Sequence, int]) -> None:
        for seq, num_tokens in scheduled.items():
            if seq not in self._running:  # aborted during the step
                continue
            seq.num_computed += num_tokens
            self._cache_full_blocks(seq)
            if seq.num_computed < len(seq.token_ids):  # a prefill chunk that is not the last
                continue
            if seq.num_output == 0:
                full = min(seq.num_cached_blocks * self.pool.block_size, seq.num_prompt_tokens)
                seq.cache.created_tokens = max(0, full - seq.cache.cached_tokens)
            token = seq.sample(seq.num_output)
            seq.token_ids.append(token)
            seq.num_output += 1
            self.stats.generation_tokens += 1
            seq.outputs.put_nowait(token)
            if seq.num_output >= seq.max_tokens:
                self._finish(seq)

    def _cache_full_blocks(self, seq: _Sequence) -> None:
        block_size = self.pool.block_size
        num_full = seq.num_computed // block_size
        if num_full <= seq.num_cached_blocks:
            return
        while len(seq.block_hashes) < num_full:  # hashes of blocks filled by generated tokens
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            start = len(seq.block_hashes) * block_size
            seq.block_hashes += self.hasher.chain(
                seq.token_ids[start : start + block_size], block_size, parent, seq.cache_salt, seq.lora
            )
        first = seq.num_cached_blocks
        self.pool.cache_blocks(
            seq.blocks[first:num_full],
            seq.block_hashes[first:num_full],
            seq.token_ids[first * block_size : num_full * block_size],
            seq.block_hashes[first - 1] if first else None,
            seq.cache_salt,
            seq.lora,
            (seq.images, first),
        )
        seq.num_cached_blocks = num_full

    def _finish(self, seq: _Sequence) -> None:
        self._running.remove(seq)
        self.pool.free(seq.blocks)
        seq.blocks = []
        reason = seq.finish_reason
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        seq.outputs.put_nowait(None)

    def _abort(self, seq: _Sequence) -> None:
        if seq in self._running:
            self._running.remove(seq)
        elif seq in self._loading:
            self._loading.remove(seq)
            if seq.loading is not None:
                seq.loading.cancel()
        elif seq in self._waiting:
            self._waiting.remove(seq)  # holding blocks if its load just ended
        else:
            return
        self.pool.free(seq.blocks)
        seq.blocks = []
        self.stats.finished["abort"] = self.stats.finished.get("abort", 0) + 1
        self._flush_events()
        self._wake.set()  # its blocks may let a waiting one in

    def _flush_events(self) -> None:
        events = self.pool.take_events()
        if events:
            self._publish(events)


def _rank(seq: _Sequence) -> Rank:
    return seq.priority, seq.arrival_s
