"""A restarted vLLM comes back with an empty cache and a KV event sequence from 0: the router drops that
instance's entries and keeps everyone else's."""

from __future__ import annotations

import random

import pytest

from kvroute.stack.run import Stack
from tests.stack.client import BLOCK, complete, metric, random_tokens, wait_steady
from tests.support.waiting import eventually

pytestmark = pytest.mark.stack


def test_restarted_instance_entries_are_dropped_and_the_others_kept(stack: Stack) -> None:
    rng = random.Random(60)
    router = stack.router_url
    restarted, other = stack.instances[0], stack.instances[1]
    for instance in (restarted, other):
        complete(instance.url, random_tokens(rng, 10 * BLOCK + 3))

    def gpu_blocks(name: str) -> float:
        return metric(router, "kvroute_index_blocks", vllm_instance=name, tier="gpu")

    eventually(
        lambda: gpu_blocks(restarted.name) >= 10 and gpu_blocks(other.name) >= 10,
        what="both instances indexed",
    )
    other_before = wait_steady(lambda: metric(router, "kvroute_index_blocks", vllm_instance=other.name))
    restarts = metric(router, "kvroute_kv_engine_restarts_total", vllm_instance=restarted.name)

    stack.restart_vllm(0)
    # Before any event: its /metrics shows a new process after a silence, so the old entries go at once.
    eventually(lambda: gpu_blocks(restarted.name) == 0, what="the restarted instance's entries dropped")
    assert metric(router, "kvroute_index_blocks", vllm_instance=other.name) == other_before
    complete(restarted.url, random_tokens(rng, 4 * BLOCK + 3))  # the new engine's first events: seq 0 again

    eventually(
        lambda: (
            metric(router, "kvroute_kv_engine_restarts_total", vllm_instance=restarted.name) == restarts + 1
        ),
        what="the router saw the sequence start over",
    )
    assert wait_steady(lambda: gpu_blocks(restarted.name)) == 4  # the new request's blocks, nothing older
    assert metric(router, "kvroute_index_blocks", vllm_instance=other.name) == other_before
