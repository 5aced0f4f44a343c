from __future__ import annotations

import json
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fleet.block_pool import BlockPool
from kvroute.cli import main
from kvroute.simulate.bench import rate_for_load, ttft_floor
from kvroute.simulate.blocks import TraceBlocks
from kvroute.simulate.clock import EventLoop
from kvroute.simulate.conducted_run import ConductedRun
from kvroute.simulate.disaggregation import PDPolicy, prefill_leg
from kvroute.simulate.engine import POOL_MEDIUM, Engine, SimRequest
from kvroute.simulate.hardware import (
    ATTENTION_S_PER_PAIR,
    DECODE_S_PER_CONTEXT_TOKEN,
    EngineSpec,
    FleetSpec,
    PDSpec,
    PoolSpec,
)
from kvroute.simulate.kv_cache import KVCache
from kvroute.simulate.peers import ActiveWork, VllmRouterKvAware
from kvroute.simulate.policies import Replicas, SimPolicy, priors_for
from kvroute.simulate.pool import PoolStore, pool_hash
from kvroute.simulate.registry import EXTRA_POLICIES, PD_POLICIES, POLICIES
from kvroute.simulate.results import RESULT_FIELDS
from kvroute.simulate.run import DisaggregatedRun, Run
from kvroute.simulate.simulation import run_kind, simulate
from kvroute.simulate.view import RouterView
from kvroute.traces import Trace, TraceRequest, agentic_trace
from router.dispatch.wait.settings import FlowControlConfig, FlowLimitsConfig
from router.index.events import BlockRemoved, BlockStored, KVEvent
from tests.kvroute.simulate.fixed_routes import Fixed

SIZE = 4


def _flat(events: list[KVEvent]) -> list[tuple[str, int]]:
    flat: list[tuple[str, int]] = []
    for event in events:
        assert isinstance(event, BlockStored | BlockRemoved)
        kind = "stored" if isinstance(event, BlockStored) else "removed"
        flat += [(kind, h if isinstance(h, int) else int.from_bytes(h, "big")) for h in event.block_hashes]
    return flat


class _Both:
    """The same requests through the simulation's KVCache and the fleet's BlockPool (vLLM's semantics)."""

    def __init__(self, blocks: int) -> None:
        self.cache = KVCache(blocks, SIZE)
        self.pool = BlockPool(blocks + 1, SIZE)  # block 0 is vLLM's null block

    def run(self, hashes: list[int], extra_blocks: int = 0) -> None:
        hits = self.cache.cached_prefix(hashes, 0, len(hashes))
        pool_hits = self.pool.cached_prefix([h.to_bytes(8, "big") for h in hashes])
        assert hits == len(pool_hits)
        new = len(hashes) - hits + extra_blocks
        held = hashes[:hits]
        assert self.cache.can_take(held, new)
        self.cache.touch(held)
        self.cache.allocate(new)
        self.pool.touch(pool_hits)
        allocated = self.pool.allocate(new)
        tokens = [1] * SIZE * (len(hashes) - hits)
        parent = hashes[hits - 1] if hits else None
        taken = self.cache.cache(hashes[hits:], parent, tokens)
        self.pool.cache_blocks(
            allocated[: len(hashes) - hits],
            [h.to_bytes(8, "big") for h in hashes[hits:]],
            tokens,
            None if parent is None else parent.to_bytes(8, "big"),
        )
        self.cache.free(held + taken, new - len(taken))
        self.pool.free(pool_hits + allocated)

    def assert_same(self) -> None:
        assert _flat(self.cache.take_events()) == _flat(self.pool.take_events())
        assert self.cache.num_free == self.pool.num_free


def test_kv_cache_announces_what_vllms_block_pool_announces() -> None:
    both = _Both(blocks=6)
    both.run([11, 12, 13])
    both.run([21, 22, 23])
    both.assert_same()
    both.run([31, 32])  # evicts from the head of the free queue: request 1's last blocks first
    events = both.cache.events[:]
    both.assert_same()
    assert _flat(events)[:2] == [("removed", 13), ("removed", 12)]
    both.run([21, 22, 41], extra_blocks=1)  # two hits, a new block and a decode block
    both.assert_same()
    assert 11 not in both.cache and 23 not in both.cache  # the next two at the head went
    assert {21, 22, 41, 31, 32} <= {h for h in (21, 22, 41, 31, 32) if h in both.cache}


def test_lru_keeps_the_blocks_used_last() -> None:
    cache = KVCache(4, SIZE)
    for hashes in ([1, 2], [3, 4]):
        cache.allocate(2)
        held = cache.cache(hashes, None, [0] * SIZE * 2)
        cache.free(held, 0)
    cache.touch([1, 2])  # a hit makes them busy, then most recently freed
    cache.free([1, 2], 0)
    cache.allocate(2)
    assert 3 not in cache and 4 not in cache and 1 in cache and 2 in cache
    assert cache.usage == pytest.approx(0.5)
    assert not cache.can_take([], 3)


def _trace(*requests: tuple[float, int, tuple[int, ...]]) -> Trace:
    return Trace("hand", 32, tuple(TraceRequest(a, n, 2, ids) for a, n, ids in requests))


def test_ideal_hit_rate_is_exact() -> None:
    trace = _trace((0, 64, (1, 2)), (1, 80, (1, 2, 3)), (2, 40, (1, 4)), (3, 64, (1, 2)))
    blocks = TraceBlocks(trace, block_size=16)
    # r2: 4 blocks of r1; r3: block 1's 2 (block 4 is partial); r4: all 4, but never its last token: 3
    assert blocks.ideal_hit_rate() == pytest.approx((0 + 64 + 32 + 48) / (64 + 80 + 40 + 64))
    assert blocks.ideal_hits == [0, 64, 32, 48]
    floor = ttft_floor(blocks, FleetSpec(engine=EngineSpec(prefill_tokens_per_s=1000.0)))
    step = EngineSpec().decode_step_s  # one step's fixed cost
    assert floor["p99_s"] == pytest.approx(np.percentile([0.064, 0.016, 0.008, 0.016], 99) + step)
    seen: set[int] = set()
    hits = 0
    for request, chain in zip(trace.requests, blocks.chains, strict=True):
        prefix = next((i for i, h in enumerate(chain) if h not in seen), len(chain))
        hits += min(prefix, (request.input_tokens - 1) // 16) * 16
        seen.update(chain)
    assert blocks.ideal_hit_rate() == pytest.approx(hits / 248)
    assert blocks.chains[0][:2] == blocks.chains[2] and blocks.chains[1][:4] == blocks.chains[0]


def _fleet(instances: int, pool: bool) -> FleetSpec:
    engine = EngineSpec(kv_blocks=400, max_waiting=8)
    return FleetSpec(
        instances, engine, PoolSpec(tokens_per_instance=10_000) if pool else None, event_delay_s=0.01
    )


def test_instances_feed_the_index_and_hit_their_own_cache() -> None:
    blocks = TraceBlocks(
        _trace((0, 320, (1, 2, 3, 4, 5, 6, 7, 8, 9, 10)), (30, 330, tuple(range(1, 12)))), 16
    )
    policy = Fixed(0, 0)
    result = simulate(blocks, _fleet(2, pool=False), policy, ideal_hit_rate=0.0)
    assert result.completed == 2 and result.rejected == 0
    assert result.local_hit_rate == pytest.approx(320 / 650)  # the second reuses all 20 blocks of the first
    assert result.pool_hit_rate == 0.0
    matches = policy.view.index.match(blocks.chains[1].tolist())
    assert set(matches) == {"sim-0"} and matches["sim-0"].gpu == 20


def test_another_instance_loads_the_prefix_from_the_pool() -> None:
    blocks = TraceBlocks(_trace((0, 320, tuple(range(1, 11))), (30, 330, tuple(range(1, 12)))), 16)
    result = simulate(blocks, _fleet(2, pool=True), Fixed(0, 1), ideal_hit_rate=0.0)
    assert result.local_hit_rate == 0.0
    assert result.pool_hit_rate == pytest.approx(320 / 650)


def test_the_pool_gets_a_prompts_blocks_its_instance_hit_as_well() -> None:
    """Turn 2 hits turn 1's prompt and answer on instance 0; the connector saves the whole prompt, the answer's
    blocks no prompt computed included, so turn 3 on instance 1 loads all of turn 2's prompt from the pool."""
    session = Trace(
        "turns",
        32,
        tuple(
            TraceRequest(arrival, tokens, 64, tuple(range(1, tokens // 32 + 1)), session="s")
            for arrival, tokens in ((0.0, 320), (30.0, 480), (60.0, 512))
        ),
    )
    run = Run(TraceBlocks(session, 16), _fleet(2, pool=True), Fixed(0, 0, 1))
    run.run(ideal_hit_rate=0.0)
    _, second, third = sorted(run.done, key=lambda r: r.number)
    # turn 1's 20 prompt blocks and 3 of its 64-token answer (the last token is sampled, never computed)
    assert second.local_hit_blocks == 23
    assert third.local_hit_blocks == 0 and third.pool_hit_blocks == 30


def test_a_full_queue_refuses() -> None:
    blocks = TraceBlocks(_trace(*((0.0, 320, (i,) * 10) for i in range(12))), 16)
    result = simulate(blocks, _fleet(1, pool=False), Fixed(*[0] * 12), ideal_hit_rate=0.0)
    assert result.rejected > 0
    assert result.completed + result.rejected == 12


class _Preferring(SimPolicy):
    """Always instance 0, unless it refused the request."""

    name = "preferring"

    def route(self, request: SimRequest) -> int:
        return min(set(range(len(self.view.instances))) - request.tried)


def test_a_refused_request_is_retried_on_another_instance_at_once() -> None:
    blocks = TraceBlocks(_trace(*((0.0, 320, (i,) * 10) for i in range(12))), 16)
    run = Run(blocks, _fleet(2, pool=False), _Preferring())
    result = run.run(ideal_hit_rate=0.0)
    assert result.rejected == 0 and result.completed == 12
    moved = [r for r in run.done if r.tried]
    assert moved and len(moved) == result.retried
    assert all(r.tried == {0} and r.instance == 1 for r in moved)
    assert all(r.dispatched_s == r.sent_s for r in moved)  # as the proxy retries a 503: no backoff


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_retries_elsewhere(name: str) -> None:
    """A retry never goes back to the instance that refused it, whatever the policy."""
    blocks = TraceBlocks(_trace((0.0, 320, (1,) * 10)), 16)
    fleet = _fleet(3, pool=True)
    loop = EventLoop()
    pool = PoolStore(fleet.pool_blocks())
    engines = [Engine(n, fleet.engine, blocks, loop, pool, 0.0) for n in range(fleet.instances)]
    policy = POLICIES[name](fleet)
    policy.bind(RouterView(fleet, loop, engines, pool, priors_for(fleet)))
    request = SimRequest(0, blocks.trace.requests[0], blocks.chains[0], "s")
    first = request.instance = policy.route(request)
    policy.refused(request)
    request.tried = frozenset({first})
    assert policy.route(request) != first


def test_the_slowest_ttfts_are_split_into_admission_queue_and_own_prefill() -> None:
    """Three 6,000-token prompts at once on an instance that holds one at a time: the last waits for both
    others to end before it is admitted, then prefills alone."""
    prompts = [tuple(range(start, start + 188)) for start in (0, 1000, 2000)]
    blocks = TraceBlocks(_trace(*((0.0, 6000, ids) for ids in prompts)), 16)
    result = simulate(blocks, _fleet(1, pool=False), Fixed(0, 0, 0), ideal_hit_rate=0.0)
    tail = result.tail
    own = EngineSpec().prefill_s(0, 6000)
    assert tail["requests"] == 1
    assert tail["own_prefill_s"] == pytest.approx(own)
    assert tail["admission_wait_s"] > 2 * own  # both others' prefill and answers
    assert tail["queued_s"] == pytest.approx(0.0, abs=1e-9)
    assert tail["ttft_s"] == pytest.approx(tail["admission_wait_s"] + own)
    assert tail["admission_over_0_5_s_share"] == pytest.approx(1 / 3)


class _Holding(Fixed):
    """Routes as told, with the router's memory hold on; records when each request is routed."""

    memory_hold_s = 30.0

    def __init__(self, *targets: int) -> None:
        super().__init__(*targets)
        self.routed_at: list[float] = []
        self.finished_at: list[float] = []

    def route(self, request: object) -> int:
        self.routed_at.append(self.view.loop.now)
        return super().route(request)

    def finished(self, request: object) -> None:
        self.finished_at.append(self.view.loop.now)


def test_the_memory_hold_routes_a_prompt_only_once_memory_frees() -> None:
    """One instance of 6,400 tokens: the second 4,000-token prompt waits in the router for the first."""
    first, second, small = (tuple(range(start, start + n)) for start, n in ((0, 125), (1000, 125), (2000, 4)))
    blocks = TraceBlocks(_trace((0.0, 4000, first), (0.001, 4000, second), (0.002, 100, small)), 16)
    policy = _Holding(0, 0, 0)
    result = simulate(blocks, _fleet(1, pool=False), policy, ideal_hit_rate=0.0)
    assert result.completed == 3 and result.rejected == 0
    assert policy.routed_at[0] == 0.0 and policy.routed_at[1] == 0.002  # the small one fits and goes
    assert policy.routed_at[2] >= policy.finished_at[0]  # the big one waited for the first to end


def test_small_run_writes_every_field_for_every_policy(tmp_path: Path) -> None:
    out = tmp_path / "sim"
    code = main(
        ["bench", "simulate", "--trace", "agentic", "--sessions", "3", "--requests", "30", "--out", str(out)]
    )
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results["policies"]) == set(POLICIES) and "kvroute" in results["policies"]
    assert 0 < results["ttft_floor"]["p50_s"] <= results["ttft_floor"]["p99_s"]
    for name, fields in results["policies"].items():
        assert set(RESULT_FIELDS) <= set(fields), name
        assert set(fields["tail"]) == {
            "requests",
            "ttft_s",
            "admission_wait_s",
            "queued_s",
            "own_prefill_s",
            "admission_over_0_5_s_share",
        }, name
        assert fields["rejected"] + fields["completed"] == 30
        assert len(fields["busy_per_instance_s"]) == 8 and fields["longest_session_s"] > 0, name
    assert (out / "simulate-policies.png").stat().st_size > 0


def test_every_variant_of_kvroutes_configuration_runs(tmp_path: Path) -> None:
    out = tmp_path / "variants"
    code = main(
        [
            "bench",
            "simulate",
            "--trace",
            "agentic",
            "--sessions",
            "2",
            "--requests",
            "12",
            "--policies",
            ",".join(EXTRA_POLICIES),
            "--out",
            str(out),
        ]
    )
    assert code == 0
    results = json.loads((out / "results.json").read_text())["policies"]
    assert set(results) == set(EXTRA_POLICIES)
    assert all(fields["completed"] == 12 for fields in results.values())


def test_attention_costs_are_the_hardwares_and_kvroutes_priors_follow(tmp_path: Path) -> None:
    """--attention-cost on: the engines pay for the context they read, and kvroute's operator, who knows
    the hardware, switches the TTFT model's attention term on with that prior."""
    runs = {}
    for setting in ("off", "on"):
        out = tmp_path / setting
        code = main(
            [
                "bench",
                "simulate",
                "--trace",
                "agentic",
                "--sessions",
                "3",
                "--requests",
                "30",
                "--policies",
                "kvroute",
                "--attention-cost",
                setting,
                "--out",
                str(out),
            ]
        )
        assert code == 0
        runs[setting] = json.loads((out / "results.json").read_text())
    engine = runs["on"]["setup"]["engine"]
    assert engine["attention_s_per_pair"] == ATTENTION_S_PER_PAIR
    assert engine["decode_s_per_context_token"] == DECODE_S_PER_CONTEXT_TOKEN
    assert runs["off"]["setup"]["engine"]["attention_s_per_pair"] == 0.0
    assert runs["on"]["ttft_floor"]["p99_s"] > runs["off"]["ttft_floor"]["p99_s"]
    assert runs["on"]["rate"] < runs["off"]["rate"]  # the same load is less traffic
    assert priors_for(FleetSpec(engine=EngineSpec(attention_s_per_pair=2e-9))).attention_s_per_pair == 2e-9
    assert priors_for(FleetSpec()).attention_s_per_pair == 0.0


def test_the_default_trace_is_the_packaged_mooncake_one(tmp_path: Path) -> None:
    code = main(["bench", "simulate", "--requests", "20", "--policies", "kvroute", "--out", str(tmp_path)])
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["trace"] == "mooncake-conversation" and results["requests"] == 20


def test_unknown_policy_is_an_error(tmp_path: Path) -> None:
    assert main(["bench", "simulate", "--policies", "magic", "--out", str(tmp_path)]) == 2


def test_skip_runs_a_later_window_of_the_trace(tmp_path: Path) -> None:
    common = ["bench", "simulate", "--trace", "agentic", "--sessions", "3", "--policies", "kvroute"]
    assert main([*common, "--skip", "-1", "--out", str(tmp_path)]) == 2
    assert main([*common, "--skip", "200", "--out", str(tmp_path)]) == 2  # nothing left
    total = len(agentic_trace(sessions=3).requests)
    assert main([*common, "--skip", str(total - 8), "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    fields = results["policies"]["kvroute"]
    assert fields["completed"] + fields["rejected"] == 8
    assert results["trace"].endswith(f"after {total - 8}")


def test_a_sessions_next_turn_waits_for_the_previous_answer() -> None:
    turns = (
        TraceRequest(0.0, 320, 50, tuple(range(1, 11)), "s"),
        TraceRequest(0.1, 330, 2, tuple(range(1, 12)), "s"),
    )
    blocks = TraceBlocks(Trace("session", 32, turns), 16)
    policy = Fixed(0, 0)
    result = simulate(blocks, _fleet(1, pool=False), policy, ideal_hit_rate=0.0)
    assert result.completed == 2
    assert result.local_hit_rate == pytest.approx(320 / 650)  # sent after the first finished: all cached
    busy = result.busy_per_instance_s
    assert busy[0] > 0 and result.longest_session_s == pytest.approx(busy[0])  # the session kept it busy


def test_the_longest_session_counts_only_time_with_a_turn_in_flight() -> None:
    """Two sessions on two instances; the first's second turn comes 100 s after its first answer."""
    turns = (
        TraceRequest(0.0, 320, 50, tuple(range(1, 11)), "long"),
        TraceRequest(0.0, 320, 50, tuple(range(20, 30)), "short"),
        TraceRequest(100.0, 330, 50, tuple(range(1, 12)), "long"),
    )
    result = simulate(
        TraceBlocks(Trace("s", 32, turns), 16), _fleet(2, pool=False), Fixed(0, 1, 0), ideal_hit_rate=0.0
    )
    busy = result.busy_per_instance_s
    assert busy[0] > busy[1] > 0
    assert result.longest_session_s == pytest.approx(busy[0])  # not the 100 s between its turns


def test_session_chains_reused_equal_chains_hashed_whole() -> None:
    turns = tuple(
        TraceRequest(float(t), n, 1, tuple(range(-(-n // 32))), "s") for t, n in enumerate((40, 64, 100, 130))
    )
    reused = TraceBlocks(Trace("s", 32, turns), 16).chains
    whole = TraceBlocks(Trace("s", 32, tuple(replace(t, session=None) for t in turns)), 16).chains
    assert reused == whole and [len(c) for c in whole] == [2, 4, 6, 8]


def test_dynamos_decode_blocks_count_a_shared_prefix_once_on_a_worker() -> None:
    """router_assume_kv_reuse (Dynamo's default): requests in flight on one worker that share blocks hold
    them once, and a new request adds only what is not there yet; the last partial block is never shared."""
    reuse, plain = ActiveWork(2, assume_kv_reuse=True), ActiveWork(2, assume_kv_reuse=False)
    first, second = [1, 2, 3, 4], [1, 2, 3, 9]  # a shared 3-block prefix; 5 blocks each with a partial one
    for work in (reuse, plain):
        work.add(0, first, 5)
    assert reuse.decode_blocks(0, second, 5) == 5 + 2 and plain.decode_blocks(0, second, 5) == 10
    assert reuse.decode_blocks(1, second, 5) == 5  # nothing of it on the other worker
    reuse.add(0, second, 5)
    reuse.remove(0, first, 5)
    assert reuse.blocks[0] == 5  # the shared blocks stay with the second request
    reuse.remove(0, second, 5)
    assert reuse.blocks == [0, 0]


class _RecordedKvAware(VllmRouterKvAware):
    def __init__(self) -> None:
        self.chosen: list[int] = []

    def route(self, request: SimRequest) -> int:
        self.chosen.append(super().route(request))
        return self.chosen[-1]


def test_vllm_router_kv_aware_multiplies_new_prefill_by_requests_in_flight() -> None:
    """0.1.17's cost, (new prefill tokens + its active prefill tokens) x (requests in flight + 1), the first
    worker on ties: a cached worker keeps its sessions though busy, and a new prefix goes where none are."""
    blocks = TraceBlocks(
        _trace(
            (0, 320, tuple(range(1, 11))),  # both idle and empty: a tie, the first worker
            (30, 330, tuple(range(1, 12))),  # 320 of its tokens cached on sim-0: 10 new there, 330 on sim-1
            (30, 330, tuple(range(50, 61))),  # sim-0: (330 + 10) x 2 = 680; sim-1: 330 x 1
            (30, 330, tuple(range(1, 12))),  # sim-0: (10 + 10) x 2 = 40; sim-1: (330 + 330) x 2 = 1,320
        ),
        16,
    )
    policy = _RecordedKvAware()
    result = simulate(blocks, _fleet(2, pool=False), policy, ideal_hit_rate=0.0)
    assert result.completed == 4
    assert policy.chosen == [0, 0, 1, 0]


def test_kvroute_confirms_pool_credit_with_the_routers_own_confirmer() -> None:
    """kvroute's policy asks the simulated pool through router/index/pool.py's PoolConfirmer, as the router asks the
    Mooncake master: a yes is trusted for pool.confirm_ttl_s (2 s), so a block the pool evicted silently keeps
    its credit until then and is forgotten at the next decision after."""
    fleet = _fleet(2, pool=True)
    blocks = TraceBlocks(_trace((0, 320, tuple(range(1, 11)))), 16)
    loop = EventLoop()
    pool = PoolStore(fleet.pool_blocks())
    engines = [Engine(n, fleet.engine, blocks, loop, pool, 0.0) for n in range(fleet.instances)]
    view = RouterView(fleet, loop, engines, pool, priors_for(fleet))
    policy = POLICIES["kvroute"](fleet)
    policy.bind(view)
    chain = blocks.chains[0].tolist()
    pool.write(chain)
    # sim-1 computed the prompt (its own cache) and wrote it to the pool, announcing both.
    computed = KVCache(400, 16)
    computed.cache(chain, None, blocks.tokens(blocks.trace.requests[0], 0, len(chain)))
    written = BlockStored(
        block_hashes=[pool_hash(h) for h in chain],
        parent_block_hash=None,
        token_ids=[],
        block_size=16,
        lora_id=None,
        medium=POOL_MEDIUM,
        lora_name=None,
    )
    view.index.apply(("sim-1", 0), [*computed.events, written])

    def route_at(time_s: float) -> list[tuple[int, bytes]]:
        request = SimRequest(0, blocks.trace.requests[0], blocks.chains[0], None)
        loop.at(time_s, lambda: policy.route(request))
        loop.run()
        return view.index.pooled(chain, 0, len(chain))

    assert len(route_at(0.0)) == 20  # confirmed: all there
    pool.write(range(10**6, 10**6 + pool.capacity))  # evicts every block of the prompt, telling no one
    assert len(route_at(1.0)) == 20  # the answer of a second ago stands
    assert route_at(2.5) == []  # asked again: gone, and forgotten


def test_attention_costs_grow_prefill_with_position_and_decode_with_context() -> None:
    """One 20,000-token prompt alone, prefilled in three chunks: with attention costs, each token also
    pays for every token before it and itself; each decode step for the context it reads."""
    prompt, answer = 20_000, 50
    blocks = TraceBlocks(Trace("one", 32, (TraceRequest(0.0, prompt, answer, tuple(range(625))),)), 16)
    flat = EngineSpec(kv_blocks=2_000)
    costly = replace(flat, attention_s_per_pair=1e-9, decode_s_per_context_token=4e-8)
    runs = {}
    for name, engine in (("flat", flat), ("costly", costly)):
        runs[name] = simulate(blocks, FleetSpec(1, engine, None, event_delay_s=0.01), Fixed(0), 0.0)
    pairs = prompt * (prompt + 1) / 2  # the chunks' positions add up to the whole prompt's
    assert runs["flat"].ttft_p50_s == pytest.approx(
        prompt / flat.prefill_tokens_per_s + 3 * flat.decode_step_s
    )
    assert runs["costly"].ttft_p50_s == pytest.approx(runs["flat"].ttft_p50_s + 1e-9 * pairs)
    step = flat.decode_step_s + flat.decode_step_s_per_seq
    decode = {name: run.e2e_p50_s - run.ttft_p50_s for name, run in runs.items()}
    assert decode["flat"] == pytest.approx((answer - 1) * step)
    # The context as the run of steps starts: the prompt and the first token.
    assert decode["costly"] == pytest.approx((answer - 1) * (step + 4e-8 * (prompt + 1)))


def test_attention_costs_raise_the_floor_and_lower_the_rate_for_a_load() -> None:
    trace = _trace((0, 4_000, tuple(range(125))), (10, 4_000, tuple(range(200, 325))))
    blocks = TraceBlocks(trace, 16)
    flat = FleetSpec(1, EngineSpec(), None)
    costly = FleetSpec(1, EngineSpec(attention_s_per_pair=1e-9), None)
    assert ttft_floor(blocks, costly)["p50_s"] == pytest.approx(
        ttft_floor(blocks, flat)["p50_s"] + 1e-9 * 4_000 * 4_001 / 2
    )
    work_flat = 8_000 / flat.engine.prefill_tokens_per_s
    work_costly = work_flat + 2 * 1e-9 * 4_000 * 4_001 / 2
    assert rate_for_load(blocks, costly, 0.7, 0.0) == pytest.approx(
        rate_for_load(blocks, flat, 0.7, 0.0) * work_flat / work_costly
    )


class _Counting(SimPolicy):
    """Sends everything to instance 0 and notes what this router counted in flight when it decided."""

    name = "counting"

    def __init__(self) -> None:
        self.seen: list[tuple[str | None, int]] = []

    def route(self, request: SimRequest) -> int:
        self.seen.append((request.session, sum(i.in_flight for i in self.view.instances)))
        return 0


def test_routers_in_front_of_one_fleet_share_events_but_not_their_counts() -> None:
    def router_of(session: str) -> int:
        return zlib.crc32(session.encode()) % 2

    names = [f"session-{n}" for n in range(20)]
    first = names[0]
    other = next(name for name in names if router_of(name) != router_of(first))
    turns = (
        TraceRequest(0.0, 320, 50, tuple(range(1, 11)), first),  # decodes for ~0.6 s
        TraceRequest(0.1, 320, 2, tuple(range(20, 30)), other),
        TraceRequest(0.2, 330, 2, tuple(range(1, 12)), first),  # waits for its first turn's answer
    )
    blocks = TraceBlocks(Trace("two routers", 32, turns), 16)
    policy = Replicas("two", _Counting, 2)
    result = simulate(blocks, _fleet(1, pool=False), policy, ideal_hit_rate=0.0)
    assert result.completed == 3
    counting = [router for router in policy.members if isinstance(router, _Counting)]
    by_router = {router_of(first): [(first, 0), (first, 0)], router_of(other): [(other, 0)]}
    # The other session's router decided while the first's turn was in flight, and did not see it.
    assert [counting[0].seen, counting[1].seen] == [by_router[0], by_router[1]]
    for router in counting:  # both indexes heard the engine: each router knows the other's prompts
        for chain in blocks.chains:
            assert router.view.index.match(chain.tolist())["sim-0"].gpu >= len(chain) - 1
        assert all(i.in_flight == 0 for i in router.view.instances)
    assert result.local_hit_rate == pytest.approx(320 / 970)  # the first session's second turn hit


def test_routers_without_sticky_sessions_take_requests_in_turn() -> None:
    turns = tuple(TraceRequest(float(n), 320, 2, tuple(range(10 * n + 1, 10 * n + 11))) for n in range(4))
    policy = Replicas("two", _Counting, 2, by_session=False)
    simulate(TraceBlocks(Trace("turns", 32, turns), 16), _fleet(1, pool=False), policy, ideal_hit_rate=0.0)
    assert [len(router.seen) for router in policy.members if isinstance(router, _Counting)] == [2, 2]


def test_routers_sharing_load_see_each_others_requests_in_flight() -> None:
    turns = (
        TraceRequest(0.0, 320, 50, tuple(range(1, 11)), "a"),  # the first router's: decodes for ~0.6 s
        TraceRequest(0.2, 320, 2, tuple(range(20, 30)), "b"),  # the second's, 0.2 s later
    )
    blocks = TraceBlocks(Trace("sharing", 32, turns), 16)
    policy = Replicas("two", _Counting, 2, by_session=False, share_s=0.05)
    simulate(blocks, _fleet(1, pool=False), policy, ideal_hit_rate=0.0)
    first, second = (router for router in policy.members if isinstance(router, _Counting))
    assert len(first.seen) == len(second.seen) == 1  # one request each
    # The later one's router heard of the earlier one within 0.05 s; sharing nothing, it would count 0.
    assert dict(first.seen + second.seen) == {"a": 0, "b": 1}


class _Limited(_Counting):
    """_Counting with a queue: one request of a flow in flight at a time."""

    queue_flows = "tenant"

    def __init__(self) -> None:
        super().__init__()
        self.flow_control = FlowControlConfig(per_flow=FlowLimitsConfig(max_in_flight=1))


@pytest.mark.parametrize(("share_s", "most"), [(None, 2), (0.05, 1)])
def test_replicas_each_queue_and_sharing_hold_a_tenants_limit_as_one(
    share_s: float | None, most: int
) -> None:
    """Two routers, each its own queue (max_in_flight 1 for the tenant), requests in turn: sharing nothing,
    the tenant has 2 in flight; sharing, 1."""
    turns = tuple(
        TraceRequest(0.01 * n, 320, 30, tuple(range(10 * n + 1, 10 * n + 11)), flow="t") for n in range(6)
    )
    policy = Replicas("two", _Limited, 2, by_session=False, share_s=share_s)
    run = Run(TraceBlocks(Trace("limited", 32, turns), 16), _fleet(2, pool=False), policy)
    run.run(0.0)
    assert len(run.done) == 6 and len(run.flows) == 2
    spans = [(r.dispatched_s, r.finish_s) for r in run.done]
    assert max(sum(start <= at < end for start, end in spans) for at, _ in spans) == most


def test_several_routers_are_not_simulated_with_a_memory_hold() -> None:
    held = _Counting()
    held.memory_hold_s = 5.0
    blocks = TraceBlocks(_trace((0, 64, (1, 2))), 16)
    with pytest.raises(ValueError, match="without holding requests"):
        simulate(blocks, _fleet(1, pool=False), Replicas("held", lambda: held, 2), ideal_hit_rate=0.0)


def test_a_run_with_one_tie_seed_repeats_exactly() -> None:
    """Two routers' random choices between equal scores interleave: unseeded, repeated runs differed."""
    turns = tuple(TraceRequest(n * 0.01, 320, 20, tuple(range(10 * n + 1, 10 * n + 11))) for n in range(40))
    blocks = TraceBlocks(Trace("ties", 32, turns), 16)
    fleet = _fleet(4, pool=False)

    def spread(tie_seed: int) -> list[int]:
        """Each request's instance."""
        policy = Replicas("two", lambda: POLICIES["kvroute"](fleet), 2, by_session=False)
        run = Run(blocks, fleet, policy, tie_seed=tie_seed)
        run.run(ideal_hit_rate=0.0)
        return [r.instance for r in sorted(run.done, key=lambda r: r.number)]

    first = spread(0)
    assert len(first) == 40
    assert spread(0) == first
    assert any(spread(seed) != first for seed in (1, 2, 3))  # the seed does decide the ties


def _pd_fleet(prefill: int, decode: int, pool: bool = False) -> FleetSpec:
    return replace(_fleet(prefill + decode, pool), pd=PDSpec(prefill, decode))


class _FixedPD(PDPolicy):
    """Each request's prefill leg on prefill (None: none), its decode leg on decode."""

    name = "fixed-pd"

    def __init__(self, *legs: tuple[int | None, int]) -> None:
        self._legs = list(legs)

    def plan(self, request: SimRequest) -> int:
        prefill, decode = self._legs.pop(0)
        if prefill is not None:
            request.prefill = prefill_leg(request, prefill)
        return decode


def test_a_decode_leg_fetches_the_prompt_the_prefill_leg_computed_and_holds_it_for_the_next_turn() -> None:
    """A cold 4,000-token prompt: 0.2 s of prefill on the prefill instance, which keeps its KV until the
    decode instance fetched it (4,000 tokens over the link), computed its last token and answered. The next
    turn, on the decode instance alone, finds the prompt there."""
    turns = (
        TraceRequest(0.0, 4000, 20, tuple(range(125)), "s"),
        TraceRequest(0.1, 4100, 20, tuple(range(129)), "s"),
    )
    blocks = TraceBlocks(Trace("pd", 32, turns), 16)
    fleet = _pd_fleet(1, 1)
    run = DisaggregatedRun(blocks, fleet, _FixedPD((0, 1), (None, 1)))
    prefill_engine, fetched = run.engines[0], run.engines[1].on_fetched
    free_at_fetch: list[int] = []
    run.engines[1].on_fetched = lambda request: (
        free_at_fetch.append(prefill_engine.kv.num_free),
        fetched(request),
    )
    result = run.run(ideal_hit_rate=0.0)
    assert result.completed == 2 and result.pd_paths == {"disaggregated": 1, "skipped": 1}
    first, second = sorted(run.done, key=lambda r: r.number)
    assert fleet.pd is not None
    prefill_s, transfer_s = fleet.engine.prefill_s(0, 4000), 4000 * fleet.pd.transfer_s_per_token
    assert first.prefill is not None and first.prefill.finish_s == pytest.approx(prefill_s)
    last_token_s = fleet.engine.prefill_s(3999, 1)
    assert first.first_token_s == pytest.approx(prefill_s + transfer_s + last_token_s)
    assert first.transferred_tokens == 4000
    assert free_at_fetch == [fleet.engine.kv_blocks - 250]  # the prefill instance held the prompt till then
    assert prefill_engine.kv.num_free == fleet.engine.kv_blocks  # and let it go once fetched
    # The decode instance's own copy, and the block the answer filled after the prompt's 250.
    assert second.prefill is None and second.local_hit_blocks == 251
    assert run.view.index.match(blocks.chains[0].tolist())["sim-1"].gpu == 250  # it announced the fetch
    assert result.itl_p50_s == pytest.approx(fleet.engine.decode_step_s + fleet.engine.decode_step_s_per_seq)


def test_kvroute_skips_the_prefill_leg_where_the_decode_instance_holds_the_prompt() -> None:
    """kvroute's own P/D decision, through its conductor (Decider.decide, PrefillLeg.worth_it,
    Decider.decode_leg): a cold long prompt takes both legs; the session's next turn, 100 tokens longer,
    goes to the decode instance that holds the rest, alone; a cold one again both legs."""
    turns = (
        TraceRequest(0.0, 4000, 20, tuple(range(125)), "s"),
        TraceRequest(0.1, 4100, 20, tuple(range(129)), "s"),
        TraceRequest(0.2, 3000, 20, tuple(range(1000, 1094)), "t"),
    )
    blocks = TraceBlocks(Trace("pd", 32, turns), 16)
    fleet = replace(_pd_fleet(2, 2), engine=EngineSpec(kv_blocks=2000))  # room: no wait for memory to learn
    policy = PD_POLICIES["kvroute"](fleet)
    assert run_kind(blocks, fleet, policy) is ConductedRun
    run = ConductedRun(blocks, fleet, policy)
    result = run.run(ideal_hit_rate=0.0)
    assert result.completed == 3 and result.rejected == result.failed == 0
    first, second, cold = sorted(run.done, key=lambda r: r.number)
    assert first.path == cold.path == "disaggregated"
    assert first.prefill is not None and fleet.role(first.prefill.instance) == "prefill"
    assert fleet.role(first.instance) == "decode"
    assert second.path == "skipped" and second.prefill is None
    assert second.instance == first.instance and second.local_hit_blocks == 251  # the answer's block too
    assert cold.transferred_tokens == 3000
    # Each instance's TTFT model learnt from its own legs: two prefill legs, two decode legs and a whole one.
    observed = {i.name: i.ttft_model.observations for i in run.view.instances}
    assert sum(observed.values()) == 5 and observed[run.view.instances[first.instance].name] == 2


def test_a_refused_prefill_leg_fails_retries_or_falls_back_as_each_router_does() -> None:
    """One prefill instance with a waiting queue of 8: a burst of cold prompts overflows it. vllm-router fails
    them (500), llm-d passes the 503 on, Dynamo (after trying another prefill instance, none here) lets the
    decode instance compute the prompt (until its own queue is full); kvroute does not send the overflow."""
    burst = tuple(TraceRequest(0.0, 4000, 2, tuple(range(200 * n, 200 * n + 125))) for n in range(20))
    blocks = TraceBlocks(Trace("burst", 32, burst), 16)
    fleet = _pd_fleet(1, 1)
    outcomes = {}
    for name, make in PD_POLICIES.items():
        result = simulate(blocks, fleet, make(fleet), ideal_hit_rate=0.0)
        assert result.completed + result.rejected + result.failed == 20, name
        outcomes[name] = (
            result.failed > 0,
            result.rejected > 0,
            result.pd_paths.get("fallback", 0),
            result.completed,
        )
    assert outcomes["vllm-router"][:3] == (True, False, 0)
    assert outcomes["llm-d"][:3] == (False, True, 0)
    assert not outcomes["dynamo"][0] and outcomes["dynamo"][2] > 0
    assert outcomes["dynamo"][3] > outcomes["llm-d"][3]
    # kvroute's flow control holds the burst in the router while the prefill instance is saturated: nothing
    # overflows its queue, and every request is served.
    assert outcomes["kvroute"] == (False, False, 0, 20)


def test_a_small_disaggregated_run_writes_every_field_for_every_router(tmp_path: Path) -> None:
    out = tmp_path / "pd"
    code = main(
        [
            "bench",
            "simulate",
            "--trace",
            "agentic",
            "--sessions",
            "3",
            "--requests",
            "30",
            "--pd",
            "2:2",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["setup"]["pd"]["prefill"] == 2 and results["setup"]["instances"] == 4
    assert set(results["policies"]) == set(PD_POLICIES)
    for name, fields in results["policies"].items():
        assert set(RESULT_FIELDS) <= set(fields), name
        assert fields["rejected"] + fields["failed"] + fields["completed"] == 30, name
        assert sum(fields["pd_paths"].values()) == fields["completed"], name
        assert 0 < fields["itl_p50_s"] <= fields["itl_p99_s"], name
        assert 0 < fields["tpot_p50_s"] <= fields["tpot_p99_s"], name
        assert 0 < fields["transferred_rate"] <= 1, name
    assert results["policies"]["vllm-router"]["pd_paths"] == {"disaggregated": 30}


@pytest.mark.parametrize(
    "arguments",
    [
        ["--pd", "2:2", "--instances", "8"],
        ["--pd", "2:2", "--policies", "round-robin"],
        ["--pd", "2:2", "--sweep", "instances"],
    ],
)
def test_disaggregated_runs_refuse_what_they_cannot_do(tmp_path: Path, arguments: list[str]) -> None:
    assert (
        main(
            ["bench", "simulate", "--trace", "agentic", "--sessions", "2", *arguments, "--out", str(tmp_path)]
        )
        == 2
    )


def test_pd_takes_prefill_and_decode_instances() -> None:
    with pytest.raises(SystemExit):
        main(["bench", "simulate", "--pd", "4"])
