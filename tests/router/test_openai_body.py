"""What the router changes in a body before forwarding it: only vLLM's full KV report mode."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from aiohttp import web

from kvroute.processes import running_router
from router.openai_body import without_full_kv_report
from tests.router.fake_upstreams import healthy, only_instance, serving
from tests.router.test_proxy import post


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
    ],
)
def test_only_the_full_kv_report_mode_is_taken_out(
    body: dict[str, object], forwarded: dict[str, object] | None
) -> None:
    raw = json.dumps(body).encode()
    out = without_full_kv_report(raw)
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
