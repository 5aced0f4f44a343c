"""The router keeps no cookies of its instances': an engine (or a gateway in front of it, with a sticky-session
cookie) that sets one for one client's request never gets it back with another client's."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from kvroute.processes import running_router
from tests.support.fake_upstreams import healthy, only_instance, serving
from tests.support.http import post

BODY = b'{"model": "tiny-llama", "prompt": "hi", "max_tokens": 1}'


def test_a_cookie_an_instance_sets_is_not_sent_back_with_later_requests(tmp_path: Path) -> None:
    cookies: list[str | None] = []

    async def sticky(request: web.Request) -> web.Response:
        await request.read()
        cookies.append(request.headers.get("Cookie"))
        answer = web.json_response({"choices": [{"text": "ok"}]})
        answer.set_cookie("sticky", "engine-a")
        return answer

    with serving(healthy, sticky) as port:
        config = only_instance("sticky", port)
        # A host name, not an address: aiohttp's default cookie jar keeps no cookie of an IP address.
        config["instances"] = [{"name": "sticky", "url": f"http://localhost:{port}"}]
        with running_router(config, tmp_path) as url:
            statuses = [post(url + "/v1/completions", BODY)[0] for _ in range(3)]
    assert statuses == [200, 200, 200]
    assert cookies == [None, None, None]
