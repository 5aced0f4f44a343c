"""A long prompt is tokenized on a worker thread: the router keeps answering everyone else meanwhile."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from aiohttp import web

from kvroute.processes import running_router
from tests.support.fake_upstreams import healthy, only_instance, serving, serving_app
from tests.support.http import post
from tests.support.responsiveness import probed_while

WORDS = "alpha beta gamma delta run tests fix the bug in module parse json value error trace".split()


def test_the_router_answers_others_while_it_tokenizes_a_megabyte_prompt(tmp_path: Path) -> None:
    async def complete(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"choices": [{"text": "ok"}]})

    prompt = " ".join(WORDS[i * 7 % len(WORDS)] + str(i % 97) for i in range(110_000))  # ~1 MiB, ~0.5M tokens
    body = json.dumps({"model": "tiny-llama", "prompt": prompt, "max_tokens": 1}).encode()
    with serving(healthy, complete) as port:
        config = only_instance("a", port)
        with running_router(config, tmp_path) as url:

            def health() -> None:
                urllib.request.urlopen(url + "/health", timeout=10).close()

            (status, headers, payload), probed = probed_while(
                health, lambda: post(url + "/v1/completions", body)
            )
    assert status == 200, payload
    assert int(headers["x-kvroute-prompt-blocks"]) > 10_000  # it was tokenized, not routed blind
    assert probed.took_s > 0.2 and len(probed.waits_s) > 5  # the check below saw the tokenization
    # Inline, every /health call during the tokenization waited for all of it (seconds for this prompt).
    assert probed.longest_s < 0.5, (probed.longest_s, probed.took_s)


def test_the_router_answers_others_while_it_translates_an_agents_megabytes_of_tools(tmp_path: Path) -> None:
    """A Responses body is decoded and translated to the chat it renders as before it is tokenized; for
    100,000 tools (past the size the router tokenizes) that took a second on the event loop."""

    async def respond(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"id": "resp_1", "object": "response", "status": "completed", "output": []})

    tools = [
        {"type": "function", "name": f"tool_{i}", "parameters": {"type": "object", "properties": {}}}
        for i in range(200_000)
    ]
    body = json.dumps({"model": "tiny-llama", "input": "hi", "tools": tools, "store": False}).encode()
    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_get("/health", healthy)
    app.router.add_post("/v1/responses", respond)
    with serving_app(app) as port:
        with running_router(only_instance("a", port), tmp_path) as url:

            def health() -> None:
                urllib.request.urlopen(url + "/health", timeout=10).close()

            (status, _, payload), probed = probed_while(health, lambda: post(url + "/v1/responses", body))
    assert status == 200, payload
    assert probed.took_s > 0.3 and len(probed.waits_s) > 3  # the check below saw the translation
    # On the loop, a probe waited for three quarters of it; decoding (a C call that keeps the GIL) stays.
    assert probed.longest_s < probed.took_s / 2, (probed.longest_s, probed.took_s)
