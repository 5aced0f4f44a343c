"""The simulator with a profile and the pool against two engines sharing a Mooncake pool: the check trace
replayed with each session's turns alternating between the instances, so that a turn loads from the pool
what the previous turn computed on the other one, and simulated on two instances whose pool loads at the
rate the engines measured, each request on the instance the replay sent it to.

Its prompts are other tokens than the one-instance check's, so that neither instance nor the pool holds any
of them before.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from kvroute.bench.calibrate.check import compare, replayed_ttfts, simulated_run, simulated_ttfts
from kvroute.bench.calibrate.probes import Engine, ProbeFailed, counter
from kvroute.simulate.hardware import EngineSpec, FleetSpec, PoolSpec
from kvroute.simulate.run import Run
from kvroute.traces import Trace

POOL_CHECK_SEED = 1
LOCAL_HITS = "vllm:prefix_cache_hits_total"  # tokens
POOL_HITS = "vllm:external_prefix_cache_hits_total"  # tokens
FAILED_LOADS = "vllm:mooncake_store_operation_failed_keys_total"
PREEMPTIONS = "vllm:num_preemptions_total"
# The engines' counters the check reports, with the labels of the samples counted.
COUNTERS: dict[str, tuple[str, ...]] = {
    LOCAL_HITS: (),
    POOL_HITS: (),
    FAILED_LOADS: ('operation="load_get"',),
    PREEMPTIONS: (),
}


def alternating(trace: Trace, instances: int) -> list[int]:
    """Each request's instance: a session's turns round robin, the n-th session's first turn on instance n
    (modulo instances), so that first turns spread as well."""
    first: dict[str | None, int] = {}
    turns: dict[str | None, int] = defaultdict(int)
    route = []
    for request in trace.requests:
        start = first.setdefault(request.session, len(first))
        route.append((start + turns[request.session]) % instances)
        turns[request.session] += 1
    return route


async def pool_check(engines: Sequence[Engine], spec: EngineSpec, trace: Trace) -> dict[str, Any]:
    await asyncio.gather(*(e.stream(e.fresh_prompt(64), 2) for e in engines))  # each pays its warm-up
    before = await _counters(engines)
    route = alternating(trace, len(engines))
    real = await replayed_ttfts(engines, trace, route, seed=POOL_CHECK_SEED)
    after = await _steady(lambda: _counters(engines))
    rates = [await e.pool_load_rate() for e in engines]
    measured = [r for r in rates if r is not None]
    if not measured:
        raise ProbeFailed("no engine loaded enough from the pool to tell its load rate")
    load_s = statistics.mean(measured)
    fleet = FleetSpec(len(engines), spec, PoolSpec(load_s_per_token=load_s))
    run = simulated_run(fleet, trace, route)
    counted = {name: after[name] - before[name] for name in before}
    return {
        **compare(real, simulated_ttfts(run)),
        "instances": len(engines),
        "engine_pool_tokens": int(counted[POOL_HITS]),
        "simulated_pool_tokens": sum(r.pool_hit_blocks for r in run.done) * spec.block_size,
        "engine_local_hit_tokens": int(counted[LOCAL_HITS]),
        "simulated_local_hit_tokens": sum(r.local_hit_blocks for r in run.done) * spec.block_size,
        "engine_pool_failed_load_keys": int(counted[FAILED_LOADS]),
        "pool_load_s_per_token": load_s,
        "engine_pool_load_s_per_token": rates,
        "engine_preemptions": int(counted[PREEMPTIONS]),
        "simulated_preemptions": sum(e.preemptions for e in run.engines),
        "trace": trace.name,
        "per_request": _per_request(route, real, run, spec.block_size),
    }


def _per_request(route: Sequence[int], real: list[float], run: Run, block_size: int) -> list[dict[str, Any]]:
    """Each request's instance, TTFT on the engine and simulated, and tokens hit and loaded in simulation:
    where the two part, by what the request loaded."""
    done = sorted(run.done, key=lambda r: r.number)
    return [
        {
            "instance": instance,
            "engine_ttft_s": round(engine_ttft, 5),
            "simulated_ttft_s": round(r.first_token_s - r.sent_s, 5),
            "prompt_tokens": r.trace.input_tokens,
            "simulated_local_hit_tokens": r.local_hit_blocks * block_size,
            "simulated_pool_tokens": r.pool_hit_blocks * block_size,
        }
        for instance, engine_ttft, r in zip(route, real, done, strict=True)
    ]


async def _counters(engines: Sequence[Engine]) -> dict[str, float]:
    bodies = await asyncio.gather(*(e.metrics() for e in engines))
    return {name: sum(counter(b, name, *labels) for b in bodies) for name, labels in COUNTERS.items()}


async def _steady(
    read: Callable[[], Awaitable[dict[str, float]]], quiet_s: float = 1.0, timeout_s: float = 30.0
) -> dict[str, float]:
    """read() once it has not changed for quiet_s: an engine's counters land shortly after its answers."""
    deadline = time.monotonic() + timeout_s
    value, since = await read(), time.monotonic()
    while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        if (current := await read()) != value:
            value, since = current, time.monotonic()
    return value
