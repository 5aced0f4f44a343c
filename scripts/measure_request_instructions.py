"""Instructions kvroute serve spends per request, counted by valgrind's callgrind: repeatable where timings
on a shared machine are not.

    python scripts/measure_request_instructions.py [--requests 50,550] [--instances 2]

The router's real app (create_app, its runtime, the fast path, the proxy) runs in-process and takes hot 2 KiB
chats one at a time through ASGI, against canned answers from an aiohttp server in another process (not
counted). The run is made twice, with the two request counts, and the difference divided by theirs: start-up
and imports cancel out. The same tree varies about 1% between runs. To measure another commit, make a
worktree of it and run this file with PYTHONPATH=WORKTREE: the router is imported from there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_CANNED = (
    b'{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"tiny-llama","choices":[{"index":0,'
    b'"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":9,"completion_tokens":1,"total_tokens":10}}'
)


def _upstream(port: int) -> None:
    from aiohttp import web

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=_CANNED, content_type="application/json")

    async def empty(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/health", empty)
    app.router.add_get("/metrics", empty)
    app.router.add_post("/v1/chat/completions", answer)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


async def _one(asgi: Any, body: bytes) -> None:
    done = asyncio.Event()
    sent: list[dict[str, Any]] = []
    first = True

    async def receive() -> dict[str, Any]:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            done.set()

    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    path = "/v1/chat/completions"
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }
    await asgi(scope, receive, send)
    if sent[0]["status"] != 200:
        raise SystemExit(f"the router answered {sent[0]['status']}")


def _route(ports: list[int], requests: int) -> None:
    from router.config import parse_config
    from router.http.app import create_app

    raw = {
        "models": [{"name": "tiny-llama"}],
        "instances": [{"name": f"i{n}", "url": f"http://127.0.0.1:{port}"} for n, port in enumerate(ports)],
        "load": {"scrape_interval_s": 3600},  # no scrapes: their count would follow the run's wall time
    }
    body = json.dumps(
        {"model": "tiny-llama", "messages": [{"role": "user", "content": "hello " * 330}], "max_tokens": 1}
    ).encode()

    async def run() -> None:
        app = create_app(parse_config(raw, source="measure"))
        async with app.api.router.lifespan_context(app.api):
            for _ in range(requests):
                await _one(app.asgi, body)

    asyncio.run(run())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_listening(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise SystemExit(f"the upstream on port {port} did not start")


def _instructions(ports: list[int], requests: int, out: Path) -> int:
    command = [
        "valgrind",
        "--tool=callgrind",
        f"--callgrind-out-file={out}",
        sys.executable,
        __file__,
        "--route",
        ",".join(map(str, ports)),
        str(requests),
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    match = re.search(r"Collected : (\d+)", result.stderr)
    if match is None:
        raise SystemExit(f"no instruction count from callgrind:\n{result.stderr[-2000:]}")
    return int(match.group(1))


def main() -> None:
    if sys.argv[1:2] == ["--upstream"]:
        _upstream(int(sys.argv[2]))
        return
    if sys.argv[1:2] == ["--route"]:
        _route([int(p) for p in sys.argv[2].split(",")], int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", default="50,550", help="the two request counts (default 50,550)")
    parser.add_argument("--instances", type=int, default=2, help="upstream instances (default 2)")
    args = parser.parse_args()
    low, high = (int(n) for n in args.requests.split(","))
    ports = [_free_port() for _ in range(args.instances)]
    upstreams = [
        subprocess.Popen([sys.executable, __file__, "--upstream", str(port)], start_new_session=True)
        for port in ports
    ]
    try:
        for port in ports:
            _wait_listening(port)
        with tempfile.TemporaryDirectory() as work:
            counts = [_instructions(ports, n, Path(work) / f"callgrind.{n}") for n in (low, high)]
    finally:
        for upstream in upstreams:
            os.killpg(upstream.pid, signal.SIGTERM)
            upstream.wait(timeout=10)
    per_request = (counts[1] - counts[0]) / (high - low)
    print(
        f"{per_request / 1e6:.3f}M instructions per request ({counts[0]:,} at {low}, {counts[1]:,} at {high})"
    )


if __name__ == "__main__":
    main()
