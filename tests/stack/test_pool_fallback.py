"""A prefix computed on one instance is loaded from the Mooncake pool by the other instead of recomputed.

Prompts are token ids, so prefixes are exact; round robin (`x-kvroute-policy: round-robin`) alternates between
the two instances, which sends the same prompt to the instance that has not seen it. Whether loading beats
computing is a performance question for the benchmarks (`kvroute bench live`), not for this test: on two shared
cores and a tiny model the two take about the same time and their order flips with the noise.
"""

from __future__ import annotations

import random
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvroute.stack.run import InstanceInfo, Stack
from router.upstreams.load_scraper import parse_pool_load_rate
from tests.stack.client import (
    BLOCK,
    INSTANCE_HEADER,
    POLICY_HEADER,
    Reply,
    complete,
    metric,
    random_tokens,
    wait_steady,
)
from tests.support.waiting import eventually

pytestmark = pytest.mark.stack

PROMPT_TOKENS = 3000
LOADED_KEYS = "vllm:mooncake_store_operation_keys_total"
TRIALS = 3
# A save the connector gave up leaves the prompt out of the pool: Mooncake's put ends in OBJECT_NOT_FOUND when
# the master discarded it while a stalled machine wrote it (seen in a full run, both engines' /metrics late by
# seconds). That trial is void and another prompt takes its place, at most this many times a test.
VOID_TRIALS = 3
ROUND_ROBIN = {POLICY_HEADER: "round-robin"}


@dataclass(frozen=True)
class PoolHit:
    computed_on: InstanceInfo
    loaded_on: InstanceInfo
    reply: Reply
    external_hit_tokens: float
    failed_pool_keys: float
    loaded_pool_keys: float


def instance(stack: Stack, name: str) -> InstanceInfo:
    return next(i for i in stack.instances if i.name == name)


def pool_keys(stack: Stack) -> float:
    assert stack.master_url is not None
    return metric(stack.master_url, "master_key_count")


def failed_saves(url: str) -> float:
    return metric(url, "vllm:mooncake_store_operation_failed_keys_total", operation="save_put")


def compute_then_load(stack: Stack, prompt: list[int]) -> PoolHit | None:
    """Send prompt round robin until a second instance serves it; the first one computed it into the pool
    (None: its connector failed to save it there)."""
    keys = pool_keys(stack)
    saves_failed = {i.name: failed_saves(i.url) for i in stack.instances}
    first = complete(stack.router_url, prompt, ROUND_ROBIN)
    computed_on = instance(stack, first.headers[INSTANCE_HEADER])
    full_blocks = len(prompt) // BLOCK

    def saved() -> str | None:
        if pool_keys(stack) >= keys + full_blocks:
            return "saved"
        return "failed" if failed_saves(computed_on.url) > saves_failed[computed_on.name] else None

    if eventually(saved, what=f"{full_blocks} blocks of the prompt in the pool") == "failed":
        return None

    def external_hits(url: str) -> float:
        return wait_steady(lambda: metric(url, "vllm:external_prefix_cache_hits_total"))

    def failed_loads(url: str) -> float:
        return metric(url, "vllm:mooncake_store_operation_failed_keys_total", operation="load_get")

    def loaded_keys(url: str) -> float:
        return metric(url, LOADED_KEYS, operation="load_get", status="ok")

    hits_before = {i.name: external_hits(i.url) for i in stack.instances}
    failed_before = {i.name: failed_loads(i.url) for i in stack.instances}
    keys_before = {i.name: loaded_keys(i.url) for i in stack.instances}
    for _ in range(len(stack.instances)):
        reply = complete(stack.router_url, prompt, ROUND_ROBIN, stream=True)
        loaded_on = instance(stack, reply.headers[INSTANCE_HEADER])
        if loaded_on != computed_on:
            hits = external_hits(loaded_on.url) - hits_before[loaded_on.name]
            failed = failed_loads(loaded_on.url) - failed_before[loaded_on.name]
            keys = loaded_keys(loaded_on.url) - keys_before[loaded_on.name]
            return PoolHit(computed_on, loaded_on, reply, hits, failed, keys)
    raise AssertionError(f"round robin kept sending the prompt to {computed_on.name}")


def pool_hits(stack: Stack, rng: random.Random) -> Iterator[PoolHit]:
    """TRIALS prompts, each computed on one instance and loaded from the pool by the other; one whose save
    failed is replaced by another, up to VOID_TRIALS times."""
    hits = void = 0
    while hits < TRIALS:
        hit = compute_then_load(stack, random_tokens(rng, PROMPT_TOKENS))
        if hit is None:
            void += 1
            assert void <= VOID_TRIALS, f"the connector failed to save {void} prompts to the pool"
            continue
        hits += 1
        yield hit


def test_prefix_computed_on_one_instance_is_loaded_from_the_pool_by_the_other(stack: Stack) -> None:
    for hit in pool_hits(stack, random.Random(40)):
        # All full blocks but the last: the engine always computes the last prompt token itself.
        loadable = (PROMPT_TOKENS - 1) // BLOCK * BLOCK
        seen = (
            f"{hit.external_hit_tokens:.0f} tokens loaded on {hit.loaded_on.name}, {hit.failed_pool_keys:.0f} pool "
            f"keys failed to load, {hit.reply.headers.get('x-kvroute-attempts')} attempts, TTFT {hit.reply.ttft_s:.1f}s"
        )
        if hit.failed_pool_keys:
            # A load that failed (a Mooncake get timing out on a loaded machine) is rescheduled under
            # kv_load_failure_policy=recompute and looked up again; the second lookup finds what the pool
            # still answers for, from nothing (the master unreachable) to the whole prefix. The first lookup
            # found the whole prefix, and the request was still answered.
            assert hit.external_hit_tokens >= loadable and "[DONE]" in hit.reply.body, seen
        else:
            assert hit.external_hit_tokens == loadable, seen
            # One key a block: what the router's pool load rate (seconds a token) divides by.
            assert hit.loaded_pool_keys * BLOCK == loadable, seen
        # The router knew: its pool tier (confirmed by the master) credited exactly the blocks loaded.
        assert int(hit.reply.headers["x-kvroute-cached-blocks"]) * BLOCK == loadable


def test_the_pool_load_rate_reads_from_the_engines_metrics(stack: Stack) -> None:
    """Each engine times its pool loads (vllm:mooncake_store_operation_*): parse_pool_load_rate's reading of
    the real body (what `kvroute bench calibrate --pool` simulates the pool with) is their seconds a key over
    a block's tokens."""
    hits = list(pool_hits(stack, random.Random(41)))  # past MIN_POOL_LOAD_KEYS
    url = hits[-1].loaded_on.url
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        measured = parse_pool_load_rate(response.read())
    seconds = metric(url, "vllm:mooncake_store_operation_time_seconds_sum", operation="load_get", status="ok")
    keys = metric(url, LOADED_KEYS, operation="load_get", status="ok")
    assert measured is not None and measured > 0
    assert measured == pytest.approx(seconds / keys / BLOCK, rel=0.05)
