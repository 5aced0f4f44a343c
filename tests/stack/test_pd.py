"""Prefill/decode disaggregation on the real stack: configs/stack-pd-cpu.yaml, 2 prefill + 1 decode vLLM with a
MultiConnector of MooncakeConnector (through kvconnectors.mooncake) and MooncakeStoreConnector.

The instances' own counters tell where each prompt token came from (`vllm:prompt_tokens_by_source_total`:
local_compute, local_cache_hit, external_kv_transfer; `vllm:prompt_tokens_cached_by_source_total`: p2p for
MooncakeConnector, external_unspecified for the pool). Prompts are ~1,200 new tokens, far past the
256 a decode instance would compute itself, so the router always runs the prefill leg. The stack takes
2-3 minutes to start on 2 cores; the tests after it about 30 s.
"""

from __future__ import annotations

import random
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvroute.processes import free_port_block
from kvroute.stack.config import load_stack_config
from kvroute.stack.run import InstanceInfo, Stack, running_stack
from tests.stack.client import (
    BLOCK,
    INSTANCE_HEADER,
    METRICS_TIMEOUT_S,
    MODEL,
    Reply,
    metric,
    post,
    wait_steady,
)
from tests.support.waiting import eventually

pytestmark = pytest.mark.stack

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "stack-pd-cpu.yaml"
PREFILL_HEADER = "x-kvroute-prefill-instance"
WORDS = ("alpha", "bravo", "delta", "kilo", "lima", "oscar", "tango", "zulu", "router", "cache", "block")
PROMPT_WORDS = 205  # ~1,200 tokens of the tiny model's tokenizer
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
TIERS = ("p2p", "external_unspecified")


@pytest.fixture(scope="module")
def pd_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    config = load_stack_config(CONFIG)
    config = config.with_ports(free_port_block(config.port_count()))
    with running_stack(config, tmp_path_factory.mktemp("pd-stack"), base_dir=REPO) as running:
        yield running


def chat(rng: random.Random) -> list[dict[str, Any]]:
    text = " ".join(f"{rng.choice(WORDS)}{rng.randrange(100)}" for _ in range(PROMPT_WORDS))
    return [{"role": "user", "content": text}]


def prompt_tokens(instance: InstanceInfo, messages: list[dict[str, Any]]) -> int:
    return int(post(instance.url + "/tokenize", {"model": MODEL, "messages": messages}).body["count"])


def token_sources(instance: InstanceInfo) -> dict[str, float]:
    """Prompt tokens so far by where they came from (SOURCES) and cached ones by tier (TIERS)."""
    with urllib.request.urlopen(instance.url + "/metrics", timeout=METRICS_TIMEOUT_S) as response:
        text = response.read().decode()
    counts = dict.fromkeys(SOURCES + TIERS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            source = sample.labels.get("source", "")
            if sample.name == "vllm:prompt_tokens_by_source_total" and source in SOURCES:
                counts[source] += sample.value
            elif sample.name == "vllm:prompt_tokens_cached_by_source_total" and source in TIERS:
                counts[source] += sample.value
    return counts


def settled_sources(instance: InstanceInfo) -> dict[str, float]:
    """token_sources once the counters stopped moving (they land shortly after the answer)."""
    wait_steady(lambda: sum(token_sources(instance).values()))
    return token_sources(instance)


def increase(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before[key] for key in after}


def by_name(stack: Stack, name: str) -> InstanceInfo:
    return next(i for i in stack.instances if i.name == name)


@dataclass(frozen=True)
class Disaggregated:
    reply: Reply
    prefill: InstanceInfo
    decode: InstanceInfo
    sources: dict[str, dict[str, float]]  # each instance's increase of token_sources


def disaggregated(stack: Stack, messages: list[dict[str, Any]], stream: bool = False) -> Disaggregated:
    """A chat through kvroute, and where its prompt tokens came from on each instance."""
    before = {i.name: settled_sources(i) for i in stack.instances}
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
    if stream:
        body["stream"] = True
    reply = post(stack.router_url + "/v1/chat/completions", body)
    after = {i.name: settled_sources(i) for i in stack.instances}
    return Disaggregated(
        reply,
        by_name(stack, reply.headers[PREFILL_HEADER]),
        by_name(stack, reply.headers[INSTANCE_HEADER]),
        {name: increase(before[name], after[name]) for name in after},
    )


def test_the_stack_has_the_roles_of_its_config(pd_stack: Stack) -> None:
    assert [(i.name, i.role) for i in pd_stack.instances] == [
        ("vllm-0", "prefill"),
        ("vllm-1", "prefill"),
        ("vllm-2", "decode"),
    ]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_long_chat_is_prefilled_on_a_prefill_instance_and_decoded_from_its_blocks(
    pd_stack: Stack, stream: bool
) -> None:
    messages = chat(random.Random(70 + stream))
    tokens = prompt_tokens(pd_stack.instances[0], messages)
    run = disaggregated(pd_stack, messages, stream)
    reply, prefill, decode, seen = run.reply, run.prefill, run.decode, run.sources
    assert (prefill.role, decode.role) == ("prefill", "decode"), reply.headers
    if stream:
        assert reply.body.rstrip().endswith("data: [DONE]") and '"content"' in reply.body
    else:
        assert (
            reply.body["choices"][0]["finish_reason"] == "length"
            and reply.body["usage"]["prompt_tokens"] == tokens
        )
    # The prefill instance computed the whole (new) prompt; the decode instance computed none of it and got
    # every token's KV from the prefill instance (p2p): the partial last block too.
    assert seen[prefill.name]["local_compute"] == tokens, seen
    assert seen[decode.name]["local_compute"] == 0, seen
    assert seen[decode.name]["external_kv_transfer"] == seen[decode.name]["p2p"] == tokens, seen


def test_a_prompt_prefilled_on_one_prefill_instance_is_loaded_from_the_pool_by_the_other(
    pd_stack: Stack,
) -> None:
    messages = chat(random.Random(80))
    tokens = prompt_tokens(pd_stack.instances[0], messages)
    master = pd_stack.master_url
    assert master is not None
    keys = metric(master, "master_key_count")
    first = disaggregated(pd_stack, messages).prefill
    full_blocks = tokens // BLOCK
    # The connector saves to the pool off its engine's step: with the rest of the suite on two cores, once
    # more than 30 s after the answer.
    eventually(
        lambda: metric(master, "master_key_count") >= keys + full_blocks,
        90.0,
        what=f"the prefill leg's {full_blocks} blocks in the pool",
    )
    other = next(i for i in pd_stack.instances if i.role == "prefill" and i != first)
    before = settled_sources(other)
    post(
        other.url + "/v1/chat/completions",
        {"model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0},
    )
    seen = increase(before, settled_sources(other))
    # Every full block before the last prompt token came from the pool; the engine computes that token's
    # block itself. Nothing came from the other prefill instance directly.
    loadable = (tokens - 1) // BLOCK * BLOCK
    assert seen["external_kv_transfer"] == seen["external_unspecified"] == loadable, seen
    assert seen["local_compute"] == tokens - loadable and seen["p2p"] == 0, seen
