"""The plain pass-through `kvroute bench overhead` measures as the floor: it must forward faithfully."""

from __future__ import annotations

import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from aiohttp import web

from kvroute.processes import free_port_block, spawn, wait_healthy
from tests.support.fake_upstreams import healthy, serving
from tests.support.http import post


async def echo(request: web.Request) -> web.Response:
    body = await request.read()
    return web.Response(body=b"echo:" + body, status=201, content_type="text/plain", charset="latin-1")


def test_it_forwards_the_body_and_returns_status_type_and_body_untouched(tmp_path: Path) -> None:
    with serving(healthy, echo) as upstream:
        port = free_port_block(1)
        argv = [
            sys.executable,
            "-m",
            "kvroute.bench.overhead.plain_proxy",
            "--port",
            str(port),
            f"http://127.0.0.1:{upstream}",
        ]
        child = spawn("plain-proxy", argv, tmp_path)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(child, [url + "/health"])
            status, headers, body = post(url + "/v1/completions", b'{"prompt": "hi"}')
            assert (status, body) == (201, b'echo:{"prompt": "hi"}')
            assert headers["content-type"] == "text/plain; charset=latin-1"
            with pytest.raises(urllib.error.HTTPError) as refused:  # only the two OpenAI POST routes go on
                urllib.request.urlopen(url + "/v1/models", timeout=10)
            assert refused.value.code == 404
        finally:
            child.stop()
