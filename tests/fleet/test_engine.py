"""The simulated engine: prefix hits, time in proportion to uncached work, preemption and aborts."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from fleet.block_pool import Adapter, BlockHasher, BlockPool
from fleet.engine import Engine, EngineTiming
from router.index.block_index import BlockIndex
from router.index.events import BlockStored, KVEvent
from router.prompt import block_hashing
from scorers.request import TierMatch

T = TypeVar("T")
BS = 16


def run(
    scenario: Callable[[Engine, list[float], list[KVEvent]], Awaitable[T]],
    blocks: int = 64,
    timing: EngineTiming | None = None,
) -> T:
    async def main() -> T:
        slept: list[float] = []

        async def record(seconds: float) -> None:
            slept.append(seconds)
            await asyncio.sleep(0)

        events: list[KVEvent] = []
        engine = Engine(BlockPool(blocks, BS), timing or EngineTiming(), BlockHasher(), sleep=record)
        engine.on_events(events.extend)
        loop = asyncio.create_task(engine.run())
        try:
            return await scenario(engine, slept, events)
        finally:
            loop.cancel()

    return asyncio.run(main())


async def collect(engine: Engine, prompt: list[int], max_tokens: int) -> list[int]:
    return [t async for t in engine.generate(prompt, max_tokens, lambda position: 1000 + position)]


async def finish(
    engine: Engine, finished: list[str], name: str, prompt: list[int], max_tokens: int, priority: int = 0
) -> None:
    """Generate to the end, then add name to finished."""
    async for _ in engine.generate(prompt, max_tokens, lambda position: 1000 + position, priority=priority):
        pass
    finished.append(name)


def test_outputs_come_from_the_sampler_in_order() -> None:
    async def scenario(engine: Engine, slept: list[float], events: list[KVEvent]) -> list[int]:
        return await collect(engine, list(range(20)), 5)

    assert run(scenario) == [1000, 1001, 1002, 1003, 1004]


def test_second_identical_prompt_hits_all_but_the_last_token_block() -> None:
    async def scenario(engine: Engine, slept: list[float], events: list[KVEvent]) -> tuple[int, int]:
        prompt = list(range(64))  # 4 full blocks
        await collect(engine, prompt, 1)
        await collect(engine, prompt, 1)
        return engine.stats.prefix_cache_queries, engine.stats.prefix_cache_hits

    # vLLM recomputes the last prompt token, so only 3 of the 4 blocks can hit.
    assert run(scenario) == (128, 48)


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_an_adapters_blocks_are_its_own_and_announced_as_vllm_announces_them(salt: str | None) -> None:
    """A LoRA request reuses nothing the base model (or another adapter) cached; its events carry the
    adapter's name and id, its name in every block's extra keys and the salt after it in the first block's;
    the router's index, fed those events, matches the prompt as the router keys it."""
    sql = Adapter("sql", 1)

    async def scenario(engine: Engine, slept: list[float], events: list[KVEvent]) -> list[int]:
        hits = []
        for lora in (None, sql, Adapter("chat", 2), sql):
            before = engine.stats.prefix_cache_hits
            _ = [t async for t in engine.generate(list(range(64)), 1, lambda position: 1000, salt, lora)]
            hits.append(engine.stats.prefix_cache_hits - before)
        published.extend(events)
        return hits

    published: list[KVEvent] = []
    # only the adapter's own second request hits (4 blocks of 16 tokens, the last one recomputed)
    assert run(scenario) == [0, 0, 0, 48]
    events = published
    adapter_events = [e for e in events if isinstance(e, BlockStored) and e.lora_name == "sql"]
    assert adapter_events and {e.lora_id for e in adapter_events} == {1}
    first = adapter_events[0]
    assert first.parent_block_hash is None
    assert first.extra_keys == [
        ("sql", salt) if salt else ("sql",),
        *[("sql",)] * (len(first.block_hashes) - 1),
    ]
    index = BlockIndex(BS)
    index.apply(("e", 0), events)

    def hashed(key: block_hashing.PromptKey) -> list[int]:
        return block_hashing.prompt_chain(list(range(64)), BS, key)

    assert index.match(hashed(block_hashing.prompt_key(salt, "sql"))) == {"e": TierMatch(4)}
    assert index.match(hashed(block_hashing.prompt_key(salt))) == {"e": TierMatch(4)}
    assert index.match(block_hashing.chain(list(range(64)), BS, block_hashing.root_for("sql"))) == {}


def test_prefill_time_is_proportional_to_uncached_tokens() -> None:
    timing = EngineTiming(prefill_tokens_per_s=1000.0, decode_s_per_token=0.5)

    async def scenario(engine: Engine, slept: list[float], events: list[KVEvent]) -> list[float]:
        prompt = list(range(160))
        await collect(engine, prompt, 1)
        await collect(engine, prompt, 1)
        return slept

    cold, warm = run(scenario, timing=timing)
    assert cold == 160 / 1000.0  # one step: the whole prompt, then the first token is sampled
    assert warm == (160 - 144) / 1000.0  # 9 of 10 blocks hit


def test_decode_steps_cost_one_decode_time_each() -> None:
    timing = EngineTiming(prefill_tokens_per_s=1000.0, decode_s_per_token=0.5)

    async def scenario(engine: Engine, slept: list[float], events: list[KVEvent]) -> list[float]:
        await collect(engine, list(range(10)), 4)
        return slept

    assert run(scenario, timing=timing) == [0.01, 0.5, 0.5, 0.5]


def test_prompt_and_generated_blocks_are_announced() -> None:
    async def scenario(engine: Engine, slept: list[float], events: list[KVEvent]) -> list[KVEvent]:
        await collect(engine, list(range(40)), 30)  # 70 tokens: 4 full blocks, the last one 69 computed
        return events

    stored = [e for e in run(scenario) if isinstance(e, BlockStored)]
    assert [len(e.block_hashes) for e in stored] == [2, 1, 1]
    assert stored[0].token_ids == list(range(32))
    assert stored[1].parent_block_hash == stored[0].block_hashes[-1]
    assert stored[2].token_ids[-1] == 1000 + 63 - 40  # generated tokens are cached too


def test_a_full_cache_preempts_and_every_request_still_finishes() -> None:
    timing = EngineTiming(max_num_seqs=4)

    async def scenario(engine: Engine, slept: list[float], events: list[KVEvent]) -> tuple[list[int], int]:
        prompts = [[i] * 40 for i in range(3)]  # 3 blocks each at the start, 5 at the end; 10 in the pool
        outputs = await asyncio.gather(*(collect(engine, p, 40) for p in prompts))
        return [len(o) for o in outputs], engine.stats.preemptions

    lengths, preemptions = run(scenario, blocks=11, timing=timing)
    assert lengths == [40, 40, 40]
    assert preemptions >= 1


@pytest.mark.parametrize(
    ("policy", "order"), [("fcfs", ["first", "low", "high"]), ("priority", ["first", "high", "low"])]
)
def test_the_priority_policy_runs_the_lowest_priority_value_first(policy: str, order: list[str]) -> None:
    """One sequence at a time: the request running goes on; of those waiting, by the priority policy the
    later one of priority -5 runs before the earlier one of 5, as vLLM's --scheduling-policy priority."""
    timing = EngineTiming(max_num_seqs=1, scheduling_policy=policy)  # type: ignore[arg-type]

    async def scenario(engine: Engine, slept: list[float], events: list[KVEvent]) -> list[str]:
        finished: list[str] = []
        first = asyncio.create_task(finish(engine, finished, "first", [1] * 20, 5))
        await asyncio.sleep(0)
        await asyncio.gather(
            first,
            finish(engine, finished, "low", [2] * 20, 5, priority=5),
            finish(engine, finished, "high", [3] * 20, 5, priority=-5),
        )
        return finished

    assert run(scenario, timing=timing) == order


def test_the_priority_policy_preempts_the_lowest_ranked_request_not_the_newest() -> None:
    timing = EngineTiming(max_num_seqs=4, scheduling_policy="priority")

    async def scenario(engine: Engine, slept: list[float], events: list[KVEvent]) -> tuple[list[str], int]:
        finished: list[str] = []
        # 3 blocks each at the start, 5 at the end; 11 in the pool: one is preempted, and finishes last.
        await asyncio.gather(
            finish(engine, finished, "worst", [1] * 40, 40, priority=9),
            finish(engine, finished, "best", [2] * 40, 40, priority=-9),
            finish(engine, finished, "middle", [3] * 40, 40),
        )
        return finished, engine.stats.preemptions

    finished, preemptions = run(scenario, blocks=11, timing=timing)
    assert preemptions >= 1
    assert finished[-1] == "worst"


def test_an_abandoned_request_is_aborted_and_frees_its_blocks() -> None:
    async def scenario(engine: Engine, slept: list[float], events: list[KVEvent]) -> tuple[int, int, int]:
        stream = engine.generate(list(range(50)), 1000, lambda position: 7)
        await anext(stream)
        running = engine.num_running
        await stream.aclose()
        return running, engine.num_running, engine.pool.num_free

    assert run(scenario) == (1, 0, 63)  # all usable blocks free again


@pytest.mark.parametrize(
    ("loaded", "warm", "sources", "queries"),
    [
        (True, False, {"local_cache_hit": 0, "external_kv_transfer": 64, "local_compute": 0}, 64),
        (True, True, {"local_cache_hit": 48, "external_kv_transfer": 16, "local_compute": 0}, 64),
        # A failed load keeps what the local cache held, and computes the rest; holding nothing, the prompt
        # is looked up again (vLLM's kv_load_failure_policy recompute).
        (False, True, {"local_cache_hit": 48, "external_kv_transfer": 0, "local_compute": 16}, 64),
        (False, False, {"local_cache_hit": 0, "external_kv_transfer": 0, "local_compute": 64}, 128),
    ],
)
def test_a_remote_load_holds_its_blocks_while_it_waits_then_runs_or_recomputes(
    loaded: bool, warm: bool, sources: dict[str, int], queries: int
) -> None:
    prompt = list(range(64))

    async def scenario(engine: Engine, slept: list[float], events: list[KVEvent]) -> tuple[int, int, int]:
        if warm:
            _ = [t async for t in engine.generate(prompt[:48] + [999] * 16, 1, lambda position: 7)]
        before = dict(engine.stats.prompt_tokens_by_source), engine.stats.prefix_cache_queries
        free = engine.pool.num_free
        gate = asyncio.Event()

        async def load() -> bool:
            await gate.wait()
            return loaded

        stream = engine.generate(prompt, 2, lambda position: 7, connector=True, load=load)
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.01)
        waiting, held = engine.num_waiting, free - engine.pool.num_free
        gate.set()
        _ = [await first] + [t async for t in stream]
        increase = {k: v - before[0][k] for k, v in engine.stats.prompt_tokens_by_source.items()}
        assert increase == sources
        return waiting, held, engine.stats.prefix_cache_queries - before[1]

    waiting, held, counted = run(scenario)
    assert (waiting, held) == (1, 4)  # counted waiting, its 4 blocks held
    assert counted == queries
