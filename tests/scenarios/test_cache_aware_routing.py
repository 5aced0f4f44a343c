"""Cache-aware routing end to end: the router's index follows the engines' KV events and routes by it.

Against a simulated fleet whose engines report their own prefix-cache hits, so every prediction the router
makes (x-kvroute-cached-blocks) is checked against what the engine really reused.
"""

from __future__ import annotations

import json
import random
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvroute.processes import FleetPorts, running_fleet, running_router
from kvroute.workload import AgentWorkload
from tests.conftest import instance_url, metric
from tests.support.http import post

BLOCK = 32
WORKLOAD = AgentWorkload(system_prompt_words=600, min_turn_words=80, max_turn_words=160, max_tokens=24)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FleetPorts, str]]:
    ports = FleetPorts.allocate(3)
    # Prefill slow enough that queued prompts are visible to routing; decode fast to keep the test short.
    args = [
        "--prefill-tps",
        "20000",
        "--decode-tps",
        "2000",
        "--lora-modules",
        "tiny-lora=/adapters/tiny-lora",
    ]
    tmp = tmp_path_factory.mktemp("cache-aware")
    config = ports.router_config()
    config["models"] = [
        {"name": "tiny-llama", "tokenizer": "builtin:tiny-llama"},
        {"name": "tiny-lora", "lora_of": "tiny-llama"},
    ]
    with (
        running_fleet(ports, tmp / "fleet", args),
        running_router(config, tmp / "router") as url,
    ):
        yield ports, url


def _turn(url: str, messages: list[dict[str, str]], session: str) -> tuple[str, int, int, str]:
    body = json.dumps(
        {"model": "tiny-llama", "messages": messages, "max_tokens": WORKLOAD.max_tokens, "temperature": 0}
    ).encode()
    status, headers, payload = post(url + "/v1/chat/completions", body, {"x-session-id": session})
    assert status == 200, payload
    reply = json.loads(payload)["choices"][0]["message"]["content"]
    return (
        headers["x-kvroute-instance"],
        int(headers["x-kvroute-cached-blocks"]),
        int(headers["x-kvroute-prompt-blocks"]),
        reply,
    )


def _hits(ports: FleetPorts, name: str) -> float:
    return metric(instance_url(ports, int(name.removeprefix("fleet-"))), "vllm:prefix_cache_hits_total")


def test_later_turns_follow_their_prefix_and_the_prediction_is_what_the_engine_reused(
    stack: tuple[FleetPorts, str],
) -> None:
    ports, url = stack
    messages = [{"role": "system", "content": f"Session {random.random()}: " + WORKLOAD.system_prompt()}]
    chosen = []
    prompt_blocks_before = 0
    for turn in range(5):
        messages.append({"role": "user", "content": WORKLOAD.user_message(1000, turn)})
        before = {f"fleet-{i}": _hits(ports, f"fleet-{i}") for i in range(3)}
        instance, cached, prompt_blocks, reply = _turn(url, messages, "one-session")
        engine_hits = (_hits(ports, instance) - before[instance]) / BLOCK
        assert cached == engine_hits, (turn, cached, engine_hits)
        assert prompt_blocks > 0
        if turn:
            assert cached > 0.8 * prompt_blocks_before  # the whole previous prompt, bar the last block
        prompt_blocks_before = prompt_blocks
        chosen.append(instance)
        messages.append({"role": "assistant", "content": reply})
    assert chosen[1:] == [chosen[0]] * 4
    assert metric(url, "kvroute_index_blocks", vllm_instance=chosen[0], tier="gpu") >= cached
    assert metric(url, "kvroute_index_bytes") > 0
    assert metric(url, "kvroute_kv_events_total", vllm_instance=chosen[0], type="BlockStored") >= 5


def test_concurrent_sessions_spread_instead_of_piling_on_the_shared_system_prompt(
    stack: tuple[FleetPorts, str],
) -> None:
    _, url = stack
    system = {"role": "system", "content": WORKLOAD.system_prompt()}  # the same for every session
    sessions, turns = 9, 4

    def session(number: int) -> list[tuple[str, int]]:
        time.sleep(0.03 * number)  # agents start a few ms apart, not in the same millisecond
        messages = [system]
        seen = []
        for turn in range(turns):
            messages.append({"role": "user", "content": WORKLOAD.user_message(number, turn)})
            instance, cached, _, reply = _turn(url, messages, f"agent-{number}")
            seen.append((instance, cached))
            messages.append({"role": "assistant", "content": reply})
        return seen

    with ThreadPoolExecutor(sessions) as pool:
        results = list(pool.map(session, range(sessions)))
    homes = Counter(Counter(instance for instance, _ in seen).most_common(1)[0][0] for seen in results)
    assert len(homes) == 3, homes  # every instance is home to some sessions
    assert max(homes.values()) <= 5, homes
    # A session may move when staying means queuing behind other sessions' first prefills (over twice the
    # cost elsewhere); it then stays where it went.
    moves = sum(seen[t][0] != seen[t - 1][0] for seen in results for t in range(1, turns))
    assert moves <= 0.2 * sessions * (turns - 1), results
    later_hits = [cached > 0 for seen in results for _, cached in seen[1:]]
    assert sum(later_hits) >= 0.8 * len(later_hits)


def test_a_restarted_router_rebuilds_its_index_from_the_engines_replay_buffers(
    stack: tuple[FleetPorts, str], tmp_path: Path
) -> None:
    ports, url = stack
    messages = [
        {"role": "system", "content": f"Replay {random.random()}: " + WORKLOAD.system_prompt()},
        {"role": "user", "content": WORKLOAD.user_message(2000, 0)},
    ]
    first, _, _, reply = _turn(url, messages, "before-restart")
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "and now?"}]
    with running_router(ports.router_config(), tmp_path) as fresh:
        # The warm start replays every buffered batch before the router answers its first request.
        for _ in range(50):
            if metric(fresh, "kvroute_kv_replays_total", vllm_instance=first, result="ok") >= 1:
                break
        instance, cached, _, _ = _turn(fresh, messages, "after-restart")
    assert instance == first
    assert cached > 0


def test_without_a_local_tokenizer_the_router_asks_an_instance(
    stack: tuple[FleetPorts, str], tmp_path: Path
) -> None:
    ports, _ = stack
    config = ports.router_config()
    config["models"] = [{"name": "tiny-llama", "tokenizer": "remote"}]
    messages = [
        {"role": "system", "content": f"Remote {random.random()}: " + WORKLOAD.system_prompt()},
        {"role": "user", "content": WORKLOAD.user_message(3000, 0)},
    ]
    with running_router(config, tmp_path) as url:
        first, _, prompt_blocks, reply = _turn(url, messages, "remote")
        assert prompt_blocks > 0
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "next"}]
        instance, cached, _, _ = _turn(url, messages, "remote")
        assert instance == first
        assert cached > 0.8 * prompt_blocks


def test_tool_requests_are_tokenized_by_the_engine_and_documents_route_blind(
    stack: tuple[FleetPorts, str],
) -> None:
    ports, url = stack
    tools = [{"type": "function", "function": {"name": "run_tests", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": f"Tools {random.random()}: " + WORKLOAD.system_prompt()},
        {"role": "user", "content": WORKLOAD.user_message(4000, 0)},
    ]
    body = {"model": "tiny-llama", "messages": messages, "max_tokens": 4, "tools": tools}
    status, headers, _ = post(
        url + "/v1/chat/completions", json.dumps(body).encode(), {"x-session-id": "tools"}
    )
    assert status == 200
    direct = json.loads(post(instance_url(ports, 0) + "/tokenize", json.dumps(body).encode())[2])["count"]
    assert int(headers["x-kvroute-prompt-blocks"]) == direct // BLOCK
    body["documents"] = [{"title": "t", "text": "x"}]
    status, headers, _ = post(url + "/v1/chat/completions", json.dumps(body).encode())
    assert status == 200
    assert headers["x-kvroute-prompt-blocks"] == "0"
    assert metric(url, "kvroute_untokenized_prompts_total", reason="UnreproducibleTemplate") == 1


def test_a_cache_salt_keeps_a_prompt_cache_to_itself_in_the_index_as_in_the_engine(
    stack: tuple[FleetPorts, str],
) -> None:
    """vLLM's cache_salt: the same prompt under another salt, or none, reuses nothing, and the router's
    prediction says so; under its own salt it reuses the prompt, and the prediction matches the engine."""
    ports, url = stack
    send = _sender(ports, url, "Tenant")
    first, cached, reused = send("tenant-a")
    assert (cached, reused) == (0, 0)
    for other in ("tenant-b", None):
        _, cached, reused = send(other)
        assert (cached, reused) == (0, 0), other
    instance, cached, reused = send("tenant-a")
    assert instance == first
    assert cached > 0 and cached == reused


def test_a_lora_adapters_prompt_is_credited_with_its_own_cache_only_as_the_engine_reuses_it(
    stack: tuple[FleetPorts, str],
) -> None:
    """An adapter's blocks are its own in vLLM: the same prompt cached by the base model is nothing to the
    adapter, and the router's prediction says so (it credited the base's blocks before); the adapter's second
    request reuses its first's, salted or not, and the prediction matches the engine."""
    ports, url = stack
    listed = json.loads(urllib.request.urlopen(url + "/v1/models", timeout=10).read())["data"]
    assert [(m["id"], m.get("parent")) for m in listed] == [("tiny-llama", None), ("tiny-lora", "tiny-llama")]
    for salt in (None, "tenant-a"):
        send = _sender(ports, url, f"Adapter {salt}")
        _, cached, reused = send(salt)
        assert (cached, reused) == (0, 0)
        _, cached, reused = send(salt, "tiny-lora")
        assert (cached, reused) == (0, 0), salt
        _, cached, reused = send(salt, "tiny-lora")
        assert cached > 0 and cached == reused, salt
        _, cached, reused = send(salt)
        assert cached > 0 and cached == reused, salt  # the base's own entries are still its own


def _sender(ports: FleetPorts, url: str, tag: str) -> Callable[..., tuple[str, int, float]]:
    """Sends one new prompt, under a salt and a model, and says where it went, the blocks the router
    predicted cached there, and the blocks the engine reused."""
    messages = [
        {"role": "system", "content": f"{tag} {random.random()}: " + WORKLOAD.system_prompt()},
        {"role": "user", "content": WORKLOAD.user_message(1000, 0)},
    ]

    def send(salt: str | None, model: str = "tiny-llama") -> tuple[str, int, float]:
        fields = {"model": model, "messages": messages, "max_tokens": 2, "temperature": 0}
        body = json.dumps(fields | ({} if salt is None else {"cache_salt": salt})).encode()
        before = {f"fleet-{i}": _hits(ports, f"fleet-{i}") for i in range(3)}
        status, headers, payload = post(url + "/v1/chat/completions", body)
        assert status == 200, payload
        instance = headers["x-kvroute-instance"]
        time.sleep(0.2)  # the engine's events reach the index
        return (
            instance,
            int(headers["x-kvroute-cached-blocks"]),
            (_hits(ports, instance) - before[instance]) / BLOCK,
        )

    return send
