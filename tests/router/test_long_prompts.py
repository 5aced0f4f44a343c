"""A long prompt is tokenized on a worker thread: the router keeps answering everyone else meanwhile."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

from aiohttp import web

from kvroute.processes import running_router
from tests.router.fake_upstreams import healthy, only_instance, serving
from tests.router.test_proxy import post

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
            waits: list[float] = []
            done = threading.Event()

            def poll() -> None:
                while not done.is_set():
                    started = time.monotonic()
                    urllib.request.urlopen(url + "/health", timeout=10).close()
                    waits.append(time.monotonic() - started)
                    time.sleep(0.02)

            poller = threading.Thread(target=poll)
            poller.start()
            started = time.monotonic()
            try:
                status, headers, payload = post(url + "/v1/completions", body)
            finally:
                took = time.monotonic() - started
                done.set()
                poller.join(15)
    assert status == 200, payload
    assert int(headers["x-kvroute-prompt-blocks"]) > 10_000  # it was tokenized, not routed blind
    assert took > 0.2 and len(waits) > 5  # the check below saw the tokenization
    # Inline, every /health call during the tokenization waited for all of it (seconds for this prompt).
    assert max(waits) < 0.5, (max(waits), took)
