"""vLLM run first come first served (its default) takes a request's `priority` and ignores it, so the router
may send it to any instance (router/dispatch/intake/engine_priority.py); a client's own reaches it replaced."""

from __future__ import annotations

import pytest

from kvroute.stack.run import Stack
from tests.stack.client import MODEL, post

pytestmark = pytest.mark.stack


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_fcfs_engine_answers_a_request_with_a_priority(stack: Stack, path: str) -> None:
    if path == "/v1/completions":
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 1, "priority": -10}
    else:
        messages = [{"role": "user", "content": "hi"}]
        body = {"model": MODEL, "messages": messages, "max_tokens": 1, "priority": -10}
    direct = post(stack.instances[0].url + path, body)
    assert direct.body["usage"]["completion_tokens"] == 1
    routed = post(stack.router_url + path, {**body, "priority": 7})  # sent on with priority 0
    assert routed.body["usage"]["completion_tokens"] == 1
