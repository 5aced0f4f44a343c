"""The router's `x-kvroute-cached-blocks` is what the engine then really finds in its own prefix cache."""

from __future__ import annotations

import random

import pytest

from kvroute.stack.run import Stack
from tests.stack.client import (
    BLOCK,
    CACHED_HEADER,
    INSTANCE_HEADER,
    POLICY_HEADER,
    complete,
    metric,
    random_tokens,
    wait_steady,
)

pytestmark = pytest.mark.stack

PREFIX_BLOCKS = 20


def test_cached_blocks_header_equals_engine_prefix_hits(stack: Stack) -> None:
    rng = random.Random(20)
    prefix = random_tokens(rng, PREFIX_BLOCKS * BLOCK)
    warm = complete(stack.router_url, prefix + random_tokens(rng, 5))
    name = warm.headers[INSTANCE_HEADER]
    instance = next(i for i in stack.instances if i.name == name)
    assert int(warm.headers[CACHED_HEADER]) == 0
    held = wait_steady(lambda: metric(stack.router_url, "kvroute_index_blocks", vllm_instance=name))
    assert held >= PREFIX_BLOCKS, "the router's index never learnt the warm-up request's blocks"
    hits_before = wait_steady(lambda: metric(instance.url, "vllm:prefix_cache_hits_total"))

    # llm-d's prefix profile, where the prefix held outweighs load: the default's predicted TTFT may
    # rightly prefer the other engine (it can load the prefix from the pool) while the two share two cores
    reply = complete(stack.router_url, prefix + random_tokens(rng, 40), {POLICY_HEADER: "precise-prefix"})

    assert reply.headers[INSTANCE_HEADER] == name
    hits = wait_steady(lambda: metric(instance.url, "vllm:prefix_cache_hits_total")) - hits_before
    assert hits == PREFIX_BLOCKS * BLOCK
    assert int(reply.headers[CACHED_HEADER]) == hits / BLOCK
