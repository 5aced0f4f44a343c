"""Pool names from the configuration: an instance counts the pool blocks of its model's pool name only, as
the router starts and across reloads that add, change and remove instances."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from router.config import ModelConfig, RouterConfig, parse_config
from router.index.block_index import BlockIndex
from router.index.pool import key_start, place_instances, pool_key
from router.runtime import Runtime, place_in_pool
from scorers.request import TierMatch
from tests.router.index.test_block_index import BS, pooled, prompt


def config(*instances: tuple[str, str]) -> RouterConfig:
    """An 8B and a 70B of one family (one tokenizer) sharing a Mooncake pool; instances as (name, model)."""
    raw: dict[str, Any] = {
        "models": [{"name": "llama-8b", "pool_name": "Llama-3.1-8B"}, {"name": "llama-70b"}],
        "block_size": BS,
        "instances": [
            {"name": name, "url": f"http://127.0.0.1:{9001 + number}", "models": [model]}
            for number, (name, model) in enumerate(instances)
        ],
        "pool": {"master_url": "http://127.0.0.1:9003"},
    }
    return parse_config(raw)


def test_each_instance_counts_the_pool_blocks_of_its_models_pool_name() -> None:
    index = BlockIndex(BS)
    place_in_pool(index, config(("a", "llama-8b"), ("a2", "llama-8b"), ("b", "llama-70b")))
    index.apply(("a", 0), [pooled(0, 6)])
    assert index.match(prompt()) == {"a": TierMatch(pool=6), "a2": TierMatch(pool=6)}
    assert [index.pool_name(i) for i in ("a", "a2", "b")] == ["Llama-3.1-8B", "Llama-3.1-8B", "llama-70b"]
    assert index.pool_members() == ["a", "a2", "b"]


def test_an_instance_listed_for_models_of_several_pool_names_counts_the_first_ones(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The index takes each instance's models' pool names, in the order they are listed, and the members."""
    index = BlockIndex(BS)
    place_instances(index, {"a": ["Llama-3.1-8B", "llama-70b"], "b": ["llama-70b"]}, members={"a"})
    assert [index.pool_name(i) for i in ("a", "b")] == ["Llama-3.1-8B", "llama-70b"]
    assert index.pool_members() == ["a"]
    assert "instance a serves models of pool names Llama-3.1-8B, llama-70b; its pool" in caplog.text


NAMESPACE = "@store_tp:4@store_pp:1@store_format:hnc"
HASH_HEX = bytes(range(32)).hex()


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        ({}, f"Llama-3.1-8B@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{HASH_HEX}"),
        (
            {"pool_cache_prefix": "team-a"},
            f"team-a@Llama-3.1-8B@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{HASH_HEX}",
        ),
        (
            {"pool_store_namespace": NAMESPACE},
            f"Llama-3.1-8B{NAMESPACE}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{HASH_HEX}",
        ),
        (
            {"pool_cache_prefix": "team-a", "pool_store_namespace": NAMESPACE},
            f"team-a@Llama-3.1-8B{NAMESPACE}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{HASH_HEX}",
        ),
    ],
)
def test_pool_keys_are_the_connectors_with_its_cache_prefix_and_store_namespace(
    settings: dict[str, str], key: str
) -> None:
    """The keys are what vLLM 0.32 writes: PoolKey(KeyMetadata("Llama-3.1-8B", 0, 0, 0, 0, cache_prefix=...,
    store_namespace=...), HASH_HEX).to_string() printed these (mooncake/store/data.py PoolKey.build_prefix);
    without either setting, the key is the one the captured connector wrote (test_pool_events)."""
    model = ModelConfig(name="llama-8b", pool_name="Llama-3.1-8B", **settings)
    assert pool_key(key_start(model), bytes(range(32))) == key


def test_instances_whose_keys_start_differently_count_each_others_pool_blocks_not() -> None:
    """Two deployments of one model sharing a master, told apart by the connector's cache_prefix: neither
    can load what the other wrote."""
    raw = {
        "models": [
            {"name": "llama-8b", "pool_name": "Llama-3.1-8B", "pool_cache_prefix": "team-a"},
            {"name": "llama-8b-b", "pool_name": "Llama-3.1-8B", "pool_cache_prefix": "team-b"},
        ],
        "block_size": BS,
        "instances": [
            {"name": "a", "url": "http://127.0.0.1:9001", "models": ["llama-8b"]},
            {"name": "b", "url": "http://127.0.0.1:9002", "models": ["llama-8b-b"]},
        ],
        "pool": {"master_url": "http://127.0.0.1:9003"},
    }
    index = BlockIndex(BS)
    place_in_pool(index, parse_config(raw))
    index.apply(("a", 0), [pooled(0, 6)])
    assert index.match(prompt()) == {"a": TierMatch(pool=6)}
    assert index.pool_name("b") == "team-b@Llama-3.1-8B"


def test_a_reload_moves_changed_instances_to_their_new_pool_name_and_removed_ones_out() -> None:
    async def reload() -> BlockIndex:
        first = config(("a", "llama-8b"), ("b", "llama-70b"), ("c", "llama-70b"))
        runtime = Runtime(first)
        index, metrics = runtime.index, runtime.metrics
        index.apply(("a", 0), [pooled(0, 6)])
        index.apply(("b", 0), [pooled(0, 2)])
        for name in ("b", "c"):  # set once, when a breaker opens: a reload must not lose b's (same URL)
            metrics.circuit_open(name).set(1)
        try:
            # b serves the 8B now (a changed instance: removed, then added); c is gone; d is new.
            runtime.apply(config(("a", "llama-8b"), ("b", "llama-8b"), ("d", "llama-70b")), "the test")
        finally:
            await runtime.subscriptions.stop()
        series = metrics.render().decode()
        assert 'kvroute_circuit_open{vllm_instance="b"} 1.0' in series
        assert 'vllm_instance="c"' not in series  # removed: its series go
        return index

    index = asyncio.run(reload())
    # What b wrote as a 70B is in the pool under the 70B's name still: it counts for the new 70B, d.
    assert index.match(prompt()) == {"a": TierMatch(pool=6), "b": TierMatch(pool=6), "d": TierMatch(pool=2)}
    assert index.pool_members() == ["a", "b", "d"]


def test_a_reload_that_takes_an_instance_out_of_the_pool_matches_a_fresh_start() -> None:
    first = config(("a", "llama-8b"), ("b", "llama-8b"))  # both read the pool: master_url is set
    raw = first.model_dump(mode="json")
    raw["instances"][1]["pool"] = False  # b changed in place: the same URL
    new = parse_config(raw)

    async def reload() -> BlockIndex:
        runtime = Runtime(first)
        try:
            assert runtime.apply(new, "the test")["removed"] == ["b"]
        finally:
            await runtime.subscriptions.stop()
        return runtime.index

    fresh = BlockIndex(BS)
    place_in_pool(fresh, new)
    assert asyncio.run(reload()).pool_members() == fresh.pool_members() == ["a"]
