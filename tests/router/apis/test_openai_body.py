"""What the router changes in a body before forwarding it: only vLLM's full KV report mode."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp import web

from kvroute.processes import running_router
from router.apis.openai_body import (
    MAX_ARGUMENTS_DEPTH,
    ChatRequest,
    CompletionRequest,
    decode_body,
    json_object,
    nesting_depth,
    without_full_kv_report,
)
from router.errors import OpenAIError
from tests.support.fake_upstreams import healthy, only_instance, serving
from tests.support.http import post


@pytest.mark.parametrize(
    ("body", "forwarded"),
    [
        ({"model": "m", "vllm_xargs": {"kv_cache_report_mode": "full"}}, {"model": "m"}),
        (
            {"model": "m", "vllm_xargs": {"kv_cache_report_mode": "full", "x": 1}},
            {"model": "m", "vllm_xargs": {"x": 1}},
        ),
        ({"model": "m", "prompt": "what is kv_cache_report_mode?"}, None),  # in the text only: untouched
        ({"model": "m", "vllm_xargs": {"x": 1}}, None),
        ({"model": "m", "vllm_xargs": "kv_cache_report_mode"}, None),
        # Spelled with an escape, as JSON allows: vLLM reads the same key.
        (
            '{"model": "m", "prompt": "p", "vllm_xargs": {"kv_cache_report_\\u006dode": "full"}}',
            {"model": "m", "prompt": "p"},
        ),
    ],
)
def test_only_the_full_kv_report_mode_is_taken_out(
    body: dict[str, object] | str, forwarded: dict[str, object] | None
) -> None:
    raw = (body if isinstance(body, str) else json.dumps({"prompt": "p", **body})).encode()
    if forwarded is not None and isinstance(body, dict):
        forwarded = {"prompt": "p", **forwarded}
    out = without_full_kv_report(raw, decode_body(raw, CompletionRequest, "m").vllm_xargs)
    if forwarded is None:
        assert out is raw
    else:
        assert msgspec.json.decode(out) == forwarded


def test_the_engine_never_gets_the_full_kv_report_mode(tmp_path: Path) -> None:
    received: list[bytes] = []

    async def complete(request: web.Request) -> web.Response:
        received.append(await request.read())
        return web.json_response({"choices": [{"text": "ok"}]})

    body = {
        "model": "tiny-llama",
        "prompt": "hi",
        "max_tokens": 1,
        "vllm_xargs": {"kv_cache_report_mode": "full"},
    }
    with serving(healthy, complete) as port:
        config = only_instance("a", port)
        with running_router(config, tmp_path) as url:
            status, _, payload = post(url + "/v1/completions", json.dumps(body).encode())
    assert status == 200, payload
    assert json.loads(received[0]) == {"model": "tiny-llama", "prompt": "hi", "max_tokens": 1}


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b'{"prompt": "hi"}', {"model": "only", "prompt": "hi"}),  # vLLM's server takes its own model
        (
            b'\xef\xbb\xbf{"model": "m", "prompt": "hi"}',
            {"model": "m", "prompt": "hi"},
        ),  # a BOM, as json does
        (b'{"model": "m", "prompt": "hi", "add_special_tokens": 0}', {"add_special_tokens": False}),
        (b'{"model": "m", "prompt": "hi", "stream": "true"}', {"stream": True}),
        (b'{"model": "m", "prompt_embeds": "AAAA"}', {"prompt": None, "prompt_embeds": "AAAA"}),  # vLLM's
        # pydantic's lax booleans and a null model, as vLLM's request models take them
        (
            b'{"model": "m", "prompt": "hi", "stream": "yes", "add_special_tokens": "Off"}',
            {"stream": True, "add_special_tokens": False},
        ),
        (b'{"model": "m", "prompt": "hi", "stream": 1.0}', {"stream": True}),
        (b'{"model": null, "prompt": "hi"}', {"model": "only"}),
    ],
)
def test_bodies_vllm_accepts_are_accepted(raw: bytes, expected: dict[str, object]) -> None:
    body = decode_body(raw, CompletionRequest, "only")
    assert {key: getattr(body, key) for key in expected} == expected


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "m", "prompt": "hi", "stream": "maybe"}',
        b'{"model": "m", "prompt": "hi", "stream": 0.5}',
        b'{"model": null, "prompt": 7}',
    ],
)
def test_what_vllm_refuses_too_is_still_refused(raw: bytes) -> None:
    with pytest.raises(OpenAIError, match="Invalid request body"):
        decode_body(raw, CompletionRequest, "only")


def _chat_with_arguments(arguments: str) -> bytes:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return json.dumps(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "go"},
                {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            ],
        }
    ).encode()


@pytest.mark.parametrize("depth", [MAX_ARGUMENTS_DEPTH + 1, 950, 100_000])
def test_tool_call_arguments_nested_past_the_limit_are_refused(depth: int) -> None:
    """vLLM parses them with json.loads, which fails past the recursion limit (~940 levels in its stack) with a
    500 the instance's circuit breaker would count: a client could open every breaker. Checked at decoding,
    whatever the request's template, tokenizer or size."""
    with pytest.raises(OpenAIError, match="nest deeper than 512 levels") as refused:
        decode_body(_chat_with_arguments("[" * depth + "]" * depth), ChatRequest, "m")
    assert (refused.value.status, refused.value.code, refused.value.param) == (
        400,
        "invalid_tool_call_arguments",
        "messages",
    )


def test_tool_call_arguments_up_to_the_limit_or_with_brackets_in_strings_are_taken() -> None:
    deep = "[" * MAX_ARGUMENTS_DEPTH + "]" * MAX_ARGUMENTS_DEPTH
    code = json.dumps({"path": "a.py", "text": "{[(" * 2000 + '\\" ]' * 10})  # brackets in a string
    for arguments in (deep, code):
        decode_body(_chat_with_arguments(arguments), ChatRequest, "m")


@pytest.mark.parametrize(
    ("text", "depth"),
    [("{}", 1), ('{"a": [1, {"b": []}]}', 4), ('{"a": "[[[["}', 1), ('["\\"[[", []]', 2), ("", 0)],
)
def test_nesting_depth_passes_over_brackets_in_strings(text: str, depth: int) -> None:
    assert nesting_depth(text) == depth


def test_a_completion_needs_a_prompt_or_its_embeddings() -> None:
    with pytest.raises(OpenAIError, match="`prompt` or `prompt_embeds` is required"):
        decode_body(b'{"model": "m", "max_tokens": 4}', CompletionRequest, None)


def test_a_body_without_a_model_needs_one_when_several_are_served() -> None:
    with pytest.raises(OpenAIError, match="`model` is required: the router serves several"):
        decode_body(b'{"messages": [{"role": "user", "content": "hi"}]}', ChatRequest, None)


@pytest.mark.parametrize(
    "decode",
    [lambda raw: decode_body(raw, ChatRequest), json_object],  # chat and completions; the agents' APIs
)
def test_a_body_that_is_no_utf8_is_refused_as_serve_refuses_it(decode: Any) -> None:
    """Behind a gateway the picker is handed the body with no UTF-8 check before it: what msgspec raises for
    it (UnicodeDecodeError, or DecodeError from 0.23) is the same 400 as `kvroute serve` answers
    (router/http/request_limits.py)."""
    with pytest.raises(OpenAIError) as raised:
        decode(b'{"model": "\x80", "messages": [{"role": "user", "content": "hi"}]}')
    assert (raised.value.status, raised.value.code) == (400, "invalid_encoding")
