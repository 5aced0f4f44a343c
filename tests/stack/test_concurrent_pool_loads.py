"""What the router's speculation rule rests on (router/dispatch/decide/decision.py): requests for one prefix
admitted while another's load of it from the Mooncake pool runs each load their own copy, since vLLM's
MooncakeStoreConnector loads asynchronously and blocks being loaded are not yet in the prefix cache.

A measurement, not a test CI runs: whether the requests overlap depends on the machine's timing.

    KVROUTE_MEASURE=1 .venv/bin/python -m pytest -s -q tests/stack/test_concurrent_pool_loads.py
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvroute.stack.run import Stack
from tests.stack.client import BLOCK, Reply, complete, metric, random_tokens, wait_steady
from tests.support.waiting import eventually

pytestmark = [
    pytest.mark.stack,
    pytest.mark.skipif(not os.environ.get("KVROUTE_MEASURE"), reason="a measurement: KVROUTE_MEASURE=1"),
]

PROMPT_TOKENS = 3000
AT_ONCE = 4
LOADED_KEYS = "vllm:mooncake_store_operation_keys_total"


def _pooled(stack: Stack, seed: int) -> list[int]:
    """A prompt computed on the first engine and saved to the pool."""
    assert stack.master_url is not None
    master = stack.master_url
    prompt = random_tokens(random.Random(seed), PROMPT_TOKENS)
    keys_before = metric(master, "master_key_count")
    complete(stack.instances[0].url, prompt)
    blocks = PROMPT_TOKENS // BLOCK
    eventually(
        lambda: metric(master, "master_key_count") >= keys_before + blocks, what="the prompt in the pool"
    )
    return prompt


def _copies_loaded(url: str, send: Callable[[], list[Reply]]) -> tuple[float, list[Reply]]:
    """The prefixes the engine at url loaded from the pool while send ran, and send's replies."""

    def loaded() -> float:
        return wait_steady(lambda: metric(url, LOADED_KEYS, operation="load_get", status="ok"))

    before = loaded()
    replies = send()
    return (loaded() - before) * BLOCK / ((PROMPT_TOKENS - 1) // BLOCK * BLOCK), replies


def test_measure_requests_admitted_during_a_pool_load_each_load_their_own_copy(stack: Stack) -> None:
    url = stack.instances[1].url
    prompt = _pooled(stack, 77)

    def together() -> list[Reply]:
        with ThreadPoolExecutor(AT_ONCE) as pool:
            return list(pool.map(lambda _: complete(url, prompt), range(AT_ONCE)))

    copies, replies = _copies_loaded(url, together)
    prompt = _pooled(stack, 78)
    in_turn, _ = _copies_loaded(url, lambda: [complete(url, prompt) for _ in range(AT_ONCE)])
    ttfts = ", ".join(f"{reply.ttft_s:.2f}" for reply in replies)
    print(
        f"\n{AT_ONCE} requests for one pooled prefix: {copies:.2f} copies loaded when sent together (TTFT {ttfts} s),"
    )
    print(f"{in_turn:.2f} when each is sent once the one before is answered")
    assert copies >= 1 and in_turn >= 1
