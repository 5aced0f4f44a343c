"""The router in front of the simulated fleet, driven by the official OpenAI client."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvroute.processes import FleetPorts, running_router
from scorers.ttft_model import TERMS, TTFTPriors
from tests.conftest import instance_url, ipv6_loopback, metric
from tests.support.fake_upstreams import answering, healthy, serving
from tests.support.http import get_json, post

MODEL = "tiny-llama"
MESSAGES = [
    {"role": "system", "content": "You are a careful coding agent."},
    {"role": "user", "content": "The test in client/test_http.py fails with a KeyError; fix it."},
]
FLEET_NAMES = {"fleet-0", "fleet-1", "fleet-2"}


@pytest.fixture(scope="module")
def client(router_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=router_url + "/v1", api_key="unused", max_retries=0)


def test_chat_non_streaming_carries_usage_and_debug_headers(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, seed=1
    )
    completion = raw.parse()
    assert raw.headers["x-kvroute-instance"] in FLEET_NAMES
    assert raw.headers["x-kvroute-policy"] == "kvroute"
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 12


@pytest.mark.parametrize("seed", [3, 11])
def test_streamed_chat_text_equals_non_streamed(client: openai.OpenAI, seed: int) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, seed=seed)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=20,
        seed=seed,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) == 20
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20


def test_streamed_completion_text_equals_non_streamed(client: openai.OpenAI) -> None:
    prompt = "def parse_retry_after(value):"
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=15, seed=5)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model=MODEL, prompt=prompt, max_tokens=15, seed=5, stream=True)
        if c.choices
    )
    assert streamed == whole.choices[0].text
    assert whole.usage is not None and whole.usage.completion_tokens == 15


def test_stream_is_relayed_chunk_by_chunk_with_headers(router_url: str) -> None:
    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 5, "stream": True}).encode()
    request = urllib.request.Request(
        router_url + "/v1/completions", data=body, headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-kvroute-instance"] in FLEET_NAMES
        events = [line for line in response.read().split(b"\n\n") if line]
    assert events[-1] == b"data: [DONE]"
    assert len(events) == 6  # five tokens, then [DONE]


def test_each_answer_says_its_predicted_ttft_and_streams_calibrate_the_instances_model(
    router_url: str,
) -> None:
    body = json.dumps({"model": MODEL, "prompt": "calibrate " * 40, "max_tokens": 2, "stream": True}).encode()
    status, headers, _ = post(router_url + "/v1/completions", body)
    assert status == 200
    instance, predicted_ms = headers["x-kvroute-instance"], float(headers["x-kvroute-predicted-ttft-ms"])
    assert predicted_ms > 0
    assert float(headers["x-kvroute-wait-caused-ms"]) >= 0  # what the choice was charged for those behind it
    assert metric(router_url, "kvroute_policy_wait_caused_weight", policy=headers["x-kvroute-policy"]) >= 0
    assert metric(router_url, "kvroute_ttft_predicted_seconds_count", vllm_instance=instance) >= 1
    assert metric(router_url, "kvroute_ttft_observed_seconds_count", vllm_instance=instance) >= 1
    assert metric(router_url, "kvroute_ttft_prediction_error_seconds_count", vllm_instance=instance) >= 1
    # The model followed what it observed. Which rates moved, and how far, depends on the TTFTs this shared
    # fleet gave (under load a rate may be fitted to 0), so only the move itself is asserted.
    rates = [
        metric(router_url, "kvroute_ttft_model_rate", vllm_instance=instance, term=term) for term in TERMS
    ]
    assert min(rates) >= 0
    assert rates != pytest.approx(TTFTPriors().rates().tolist())


def test_models_lists_the_fleets_models(client: openai.OpenAI, router_url: str) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    # As vLLM's own card says it (the instances' least, read when they came up): clients size prompts by it.
    (card,) = get_json(router_url + "/v1/models")["data"]
    assert card["max_model_len"] == 32768


def test_health_reports_healthy_instances(router_url: str) -> None:
    health = get_json(router_url + "/health")
    assert health["status"] == "ok"
    assert set(health["healthy_instances"]) == FLEET_NAMES
    assert health["unhealthy_instances"] == health["unavailable_models"] == health["warnings"] == []


def test_health_warns_of_engines_whose_blocks_the_index_cannot_hold(
    fleet: FleetPorts, tmp_path: Path
) -> None:
    """The fleet's blocks are of 32 tokens: a router configured for 16 would route blind, and says so."""
    with running_router(fleet.router_config(block_size=16), tmp_path) as url:
        deadline = time.monotonic() + 10
        attempt = 0
        # New prompts until one's blocks are heard of: the first may be published before the router listens.
        while not (health := get_json(url + "/health"))["warnings"] and time.monotonic() < deadline:
            prompt = f"attempt {attempt}: a prompt long enough for a block " * 8
            body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2})
            assert post(url + "/v1/completions", body.encode())[0] == 200
            attempt += 1
            time.sleep(0.2)
    assert health["status"] == "degraded"  # still 200: the router serves, but routes blind
    assert health["warnings"], health  # the instances that served a prompt, or replayed one at start
    assert all(
        warning.endswith("publishes KV blocks of 32 tokens; block_size is 16")
        for warning in health["warnings"]
    )


def _error(status: int, code: str, param: str | None, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"status": status, "type": kind, "code": code, "param": param}


@pytest.mark.parametrize(
    ("path", "body", "expected"),
    [
        ("/v1/chat/completions", b"{not json", _error(400, "invalid_json", None)),
        ("/v1/chat/completions", b"", _error(400, "invalid_json", None)),
        ("/v1/chat/completions", b"[1, 2]", _error(400, "invalid_field", None)),
        ("/v1/chat/completions", b'{"model": "tiny-llama"}', _error(400, "invalid_field", "messages")),
        (
            "/v1/chat/completions",
            b'{"model": "tiny-llama", "messages": []}',
            _error(400, "invalid_field", "messages"),
        ),
        ("/v1/chat/completions", b'{"model": 7, "messages": []}', _error(400, "invalid_field", "model")),
        ("/v1/completions", b'{"model": "tiny-llama"}', _error(400, "invalid_field", "prompt")),
        (
            "/v1/completions",
            b'{"model": "tiny-llama", "prompt": "x", "stream": "maybe"}',
            _error(400, "invalid_field", "stream"),
        ),
        (
            "/v1/completions",
            b'{"model": "no-such-model", "prompt": "x"}',
            _error(404, "model_not_found", "model"),
        ),
        (
            "/v1/chat/completions",
            b'{"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}',
            _error(404, "model_not_found", "model"),
        ),
    ],
)
def test_client_errors_have_openai_shape(
    router_url: str, path: str, body: bytes, expected: dict[str, Any]
) -> None:
    status, headers, payload = post(router_url + path, body)
    assert status == expected["status"]
    assert headers["content-type"] == "application/json"
    error = json.loads(payload)
    assert set(error) == {"error"}
    assert set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["type"] == expected["type"]
    assert error["error"]["code"] == expected["code"]
    assert error["error"]["param"] == expected["param"]
    assert error["error"]["message"]


def test_unknown_route_is_vllms_404(router_url: str) -> None:
    status, _, payload = post(router_url + "/v1/nothing/here", b"{}")
    assert (status, json.loads(payload)) == (404, {"detail": "Not Found"})


def test_the_engines_other_routes_reach_an_instance(router_url: str, fleet: FleetPorts) -> None:
    """vLLM's routes beyond chat and completions go to an instance, by load and model."""
    body = json.dumps({"model": MODEL, "prompt": "hello there"}).encode()
    direct_status, _, direct_payload = post(instance_url(fleet, 0) + "/tokenize", body)
    status, headers, payload = post(router_url + "/tokenize", body)
    assert (status, payload) == (direct_status, direct_payload) and status == 200
    assert headers["x-kvroute-instance"] in FLEET_NAMES


def test_upstream_4xx_is_passed_through_unchanged(router_url: str, fleet: FleetPorts) -> None:
    body = json.dumps({"model": MODEL, "prompt": "too long", "max_tokens": 10_000_000}).encode()
    direct_status, _, direct_payload = post(instance_url(fleet, 0) + "/v1/completions", body)
    status, headers, payload = post(router_url + "/v1/completions", body)
    assert (status, payload) == (direct_status, direct_payload)
    assert status == 400
    assert json.loads(payload)["error"]["param"] == "max_tokens"
    assert headers["x-kvroute-instance"] in FLEET_NAMES


def test_forced_round_robin_cycles_through_the_fleet(router_url: str) -> None:
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    chosen = [
        post(router_url + "/v1/completions", body, {"x-kvroute-policy": "round-robin"})[1][
            "x-kvroute-instance"
        ]
        for _ in range(6)
    ]
    assert set(chosen[:3]) == FLEET_NAMES
    assert chosen[3:] == chosen[:3]


def test_unknown_forced_policy_is_a_400(router_url: str) -> None:
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    status, _, payload = post(router_url + "/v1/completions", body, {"x-kvroute-policy": "nope"})
    assert status == 400
    assert json.loads(payload)["error"]["code"] == "unknown_policy"


def test_least_loaded_spreads_concurrent_requests(router_url: str) -> None:
    body = json.dumps({"model": MODEL, "prompt": "hold", "max_tokens": 400}).encode()
    forced = {"x-kvroute-policy": "least-loaded"}
    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda _: post(router_url + "/v1/completions", body, forced), range(6)))
    assert all(status == 200 for status, _, _ in responses)
    spread = Counter(headers["x-kvroute-instance"] for _, headers, _ in responses)
    assert sorted(spread.values()) == [2, 2, 2]


def test_metrics_count_requests_by_policy_instance_and_status(router_url: str, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="count me", max_tokens=1)
    with urllib.request.urlopen(router_url + "/metrics", timeout=10) as response:
        families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
    requests = families["kvroute_requests"].samples
    assert any(
        s.labels["policy"] == "kvroute" and s.labels["status"] == "200" and s.value >= 1 for s in requests
    )
    assert {s.labels["vllm_instance"] for s in requests} <= FLEET_NAMES
    for name in (
        "kvroute_time_to_first_byte_seconds",
        "kvroute_request_duration_seconds",
        "kvroute_routing_decision_seconds",
        "kvroute_instance_healthy",
        "kvroute_rejected_requests",
    ):
        assert name in families, name


def test_stream_arrives_while_generating_and_a_hang_up_aborts_it(router_url: str, fleet: FleetPorts) -> None:
    # 5,000 tokens take 5 s at the fleet's 1,000 tokens/s: the first chunk must arrive long before the end.
    body = json.dumps({"model": MODEL, "prompt": "long story", "max_tokens": 5000, "stream": True}).encode()
    request = urllib.request.Request(
        router_url + "/v1/completions", data=body, headers={"content-type": "application/json"}
    )
    response = urllib.request.urlopen(request, timeout=30)
    name = response.headers["x-kvroute-instance"]
    instance = instance_url(fleet, int(name.removeprefix("fleet-")))
    assert response.readline().startswith(b"data: {")
    assert (
        metric(instance, "vllm:num_requests_running") == 1
    )  # still generating: the router relayed without buffering
    assert metric(router_url, "kvroute_instance_in_flight", vllm_instance=name) == 1
    response.close()
    for _ in range(100):  # the router closes its upstream connection, the engine aborts the request
        if (
            metric(instance, "vllm:num_requests_running") == 0
            and metric(router_url, "kvroute_instance_in_flight", vllm_instance=name) == 0
        ):
            break
        time.sleep(0.05)
    assert metric(instance, "vllm:num_requests_running") == 0
    assert metric(router_url, "kvroute_instance_in_flight", vllm_instance=name) == 0


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback (::1) on this machine")
def test_an_instance_at_an_ipv6_address_is_checked_and_served(tmp_path: Path) -> None:
    with serving(healthy, answering, host="::1") as port:
        config = {"models": [{"name": MODEL}], "instances": [{"name": "v6", "url": f"http://[::1]:{port}"}]}
        with running_router(config, tmp_path) as url:
            assert metric(url, "kvroute_instance_healthy", vllm_instance="v6") == 1
            body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
            status, headers, payload = post(url + "/v1/completions", body)
    assert status == 200, payload
    assert {k.lower(): v for k, v in headers.items()}["x-kvroute-instance"] == "v6"
