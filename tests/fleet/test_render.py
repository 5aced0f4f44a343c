"""The simulated fleet's render endpoints answer as vLLM 0.32 does with ``--enable-scale-out``."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvroute.bench.live.run import Fleet, find_vllm_router, vllm_router_args
from kvroute.processes import FleetPorts, free_port_block, spawn, wait_healthy
from router.config import parse_config
from tests.conftest import instance_url, metric

MODEL = "tiny-llama"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Fix the test."}]

# GenerateRequest.model_dump() from vLLM 0.32's own classes for these requests (request_id and token_ids
# aside): the greedy chat one, and a streamed completion of token ids without max_tokens.
VLLM_CHAT_GREEDY = {
    "token_offsets": None,
    "features": None,
    "content_parts": None,
    "sampling_params": {
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "temperature": 0.0,
        "seed": 3,
        "stop": [],
        "stop_token_ids": [],
        "max_tokens": 4,
        "output_kind": 2,
        "skip_clone": True,
        "bad_words": [],
        "skip_reading_prefix_cache": False,
    },
    "model": MODEL,
    "reasoning_ended": None,
    "reasoning_parser_kwargs": None,
    "return_token_ids": None,
    "output_mode": "tokens",
    "stream": False,
    "stream_options": None,
    "cache_salt": None,
    "priority": 0,
    "kv_transfer_params": None,
    "ec_transfer_params": None,
}
VLLM_COMPLETION_STREAM_SAMPLING = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "min_p": 0.0,
    "stop": [],
    "stop_token_ids": [],
    "output_kind": 1,
    "skip_clone": True,
    "bad_words": [],
    "skip_reading_prefix_cache": False,
}


def _post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_chat_render_is_the_engines_prompt(fleet: FleetPorts) -> None:
    base = instance_url(fleet, 0)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0, "seed": 3}
    status, rendered = _post(base + "/v1/chat/completions/render", body, {"X-Request-Id": "abc"})
    _, tokenized = _post(base + "/tokenize", {"model": MODEL, "messages": MESSAGES})

    assert status == 200
    assert rendered.pop("request_id") == "chatcmpl-abc"
    assert rendered.pop("token_ids") == tokenized["tokens"]
    assert rendered == VLLM_CHAT_GREEDY


def test_reasoning_effort_reaches_the_chat_endpoints_template_not_tokenizes(fleet: FleetPorts) -> None:
    """As vLLM: the chat endpoint passes it as kwargs (with enable_thinking); /tokenize takes no such field."""
    base = instance_url(fleet, 0)
    body = {"model": MODEL, "messages": MESSAGES, "reasoning_effort": "none"}
    _, rendered = _post(base + "/v1/chat/completions/render", body)
    _, ignored = _post(base + "/tokenize", body)
    kwargs = {"reasoning_effort": "none", "enable_thinking": False}
    _, as_kwargs = _post(
        base + "/tokenize", {"model": MODEL, "messages": MESSAGES, "chat_template_kwargs": kwargs}
    )
    _, plain = _post(base + "/tokenize", {"model": MODEL, "messages": MESSAGES})
    assert rendered["token_ids"] == as_kwargs["tokens"] != plain["tokens"] == ignored["tokens"]


def test_completion_render_is_a_list_per_prompt(fleet: FleetPorts) -> None:
    prompt = list(range(3, 40))
    body = {"model": MODEL, "prompt": prompt, "stream": True, "stream_options": {"include_usage": True}}
    status, rendered = _post(instance_url(fleet, 1) + "/v1/completions/render", body)

    assert status == 200 and len(rendered) == 1
    (request,) = rendered
    assert request["request_id"].startswith("cmpl-") and len(request["request_id"]) == 5 + 16
    assert request["token_ids"] == prompt
    assert request["sampling_params"] == VLLM_COMPLETION_STREAM_SAMPLING
    assert request["stream"] is True
    assert request["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions/render", {"model": "other", "prompt": [5, 6]}, 404, "model"),
        ("/v1/completions/render", {"model": MODEL}, 400, "prompt"),
        ("/v1/completions/render", {"model": MODEL, "prompt": [5] * 40_000}, 400, "input_tokens"),
        ("/v1/chat/completions/render", {"model": MODEL, "messages": []}, 400, "messages"),
    ],
)
def test_render_errors(fleet: FleetPorts, path: str, body: dict[str, Any], status: int, param: str) -> None:
    got, answer = _post(instance_url(fleet, 0) + path, body)
    assert got == status
    assert answer["error"]["code"] == status and answer["error"]["param"] == param


@pytest.mark.skipif(
    find_vllm_router(None) is None, reason="vllm-router not installed (pip install '.[bench]')"
)
def test_vllm_router_cache_aware_renders_every_request(fleet: FleetPorts, tmp_path: Path) -> None:
    binary = find_vllm_router(None)
    assert binary is not None
    raw = fleet.router_config()
    port = free_port_block(2)
    child = spawn(
        "vllm-router",
        vllm_router_args(binary, "cache_aware", Fleet(parse_config(raw), raw), port, port + 1),
        tmp_path,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(child, [url + "/health"], timeout_s=60)
        for turn in range(2):
            messages = [*MESSAGES, {"role": "user", "content": f"turn {turn}"}]
            status, _ = _post(
                url + "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2}
            )
            assert status == 200
        metrics = f"http://127.0.0.1:{port + 1}"
        renders = metric(metrics, "vllm_router_kv_routing_inputs_total", transport="http", result="render")
        decisions = metric(
            metrics,
            "vllm_router_prefix_routing_decisions_total",
            policy="cache_aware",
            stage="regular",
            outcome="prefix_hit",
        )
    finally:
        child.stop()
    assert renders == 2 * fleet.count  # it renders each request on every instance
    assert decisions >= 1  # the second turn matched the first one's tokens
