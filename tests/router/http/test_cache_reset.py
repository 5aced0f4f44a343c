"""POST /reset_prefix_cache (and vLLM's other cache resets) through the router, against a simulated fleet.

The router runs in this process, on uvicorn in a thread (so that a test can shorten the resets' timeout): the
index is read as the router shows it (/dashboard/state), the engines' caches as they show them (/debug/cache).
"""

from __future__ import annotations

import contextlib
import functools
import json
import socket
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import pytest

import router.http.app
from kvroute.processes import FleetPorts, free_port_block, running_fleet
from router.http.cache_reset import RESET_TIMEOUT_S, cache_reset_routes
from tests.conftest import instance_url, sample
from tests.support import in_process
from tests.support.http import get_json, post
from tests.support.waiting import eventually

TOKEN = "test-admin-token-0123456789"
AUTH = {"authorization": f"Bearer {TOKEN}"}
NAMES = ["fleet-0", "fleet-1"]
# Long enough for several 32-token blocks.
PROMPT = " ".join(f"word{i}" for i in range(150))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetPorts]:
    """A fleet of its own: resets would clear the caches other tests' shared fleet holds."""
    ports = FleetPorts.allocate(len(NAMES))
    args = ["--prefill-tps", "200000", "--decode-tps", "1000"]
    with running_fleet(ports, tmp_path_factory.mktemp("fleet"), args):
        yield ports


@contextlib.contextmanager
def serving(
    raw: dict[str, Any], monkeypatch: pytest.MonkeyPatch, timeout_s: float = RESET_TIMEOUT_S
) -> Iterator[str]:
    """The router of raw, its resets waiting timeout_s for each engine, on a free port; yields its URL."""
    routes = functools.partial(cache_reset_routes, timeout_s=timeout_s)
    monkeypatch.setattr(router.http.app, "cache_reset_routes", routes)
    with in_process.serving(raw) as url:
        yield url


def call(url: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    status, _, body = post(url, b"", headers)
    return status, json.loads(body) if body else None


def chat(url: str, max_tokens: int = 2) -> dict[str, str]:
    """The answer's headers."""
    body = {
        "model": "tiny-llama",
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": PROMPT}],
    }
    status, headers, payload = post(url + "/v1/chat/completions", json.dumps(body).encode())
    assert status == 200, payload
    return {k.lower(): v for k, v in headers.items()}


def indexed(url: str, headers: dict[str, str] | None = None) -> dict[str, int]:
    """GPU blocks the router's index holds, by instance."""
    request = urllib.request.Request(url + "/dashboard/state", headers=headers or {})
    with urllib.request.urlopen(request, timeout=10) as response:
        state = json.load(response)
    return {i["name"]: i["blocks"]["gpu"] for i in state["instances"]}


def engine_blocks(fleet: FleetPorts) -> dict[str, int]:
    """Distinct blocks each engine's cache holds, as the engine says."""
    return {
        name: get_json(f"{instance_url(fleet, i)}/debug/cache")["block_hashes"]
        for i, name in enumerate(NAMES)
    }


def in_step(url: str, fleet: FleetPorts, instance: str, headers: dict[str, str] | None = None) -> None:
    """Waits until the index holds what instance's engine holds, some blocks (its events are in)."""
    eventually(
        lambda: indexed(url, headers)[instance] == engine_blocks(fleet)[instance] > 0,
        what=f"{instance}'s blocks in the index",
    )


def test_a_reset_empties_every_engine_and_the_index_at_once(
    fleet: FleetPorts, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The speculative entries of the requests just routed go too (their deadline is 2 s away).
    with serving(fleet.router_config(), monkeypatch) as url:
        instance = chat(url)["x-kvroute-instance"]
        in_step(url, fleet, instance)
        assert int(chat(url)["x-kvroute-cached-blocks"]) > 0  # a repeat is predicted to hit

        status, body = call(url + "/reset_prefix_cache")
        assert status == 200 and body == {"success": True, "instances": dict.fromkeys(NAMES, True)}
        assert engine_blocks(fleet) == dict.fromkeys(NAMES, 0)
        # No engine serves the multi-modal cache's reset (no VLLM_SERVER_DEV_MODE): neither does the router.
        assert call(url + "/reset_mm_cache") == (404, {"detail": "Not Found"})
        # At once: an idle engine's AllBlocksCleared waits for its next step.
        assert indexed(url) == dict.fromkeys(NAMES, 0)
        repeat = chat(url)
        assert repeat["x-kvroute-cached-blocks"] == "0"
        # The event came with that request's step, before its blocks: the index holds what the engine holds.
        in_step(url, fleet, repeat["x-kvroute-instance"])


def test_with_an_admin_token_a_reset_needs_it(fleet: FleetPorts, monkeypatch: pytest.MonkeyPatch) -> None:
    with serving(fleet.router_config(admin={"token": TOKEN}), monkeypatch) as url:
        instance = chat(url)["x-kvroute-instance"]
        in_step(url, fleet, instance, AUTH)
        status, body = call(url + "/reset_prefix_cache")
        assert status == 401 and body["error"]["code"] == "missing_token"
        status, body = call(url + "/reset_prefix_cache", {"authorization": "Bearer wrong-token-0000000000"})
        assert status == 403 and body["error"]["code"] == "wrong_token"
        assert engine_blocks(fleet)[instance] > 0 and indexed(url, AUTH)[instance] > 0  # neither reset

        status, body = call(url + "/reset_prefix_cache", AUTH)
        assert status == 200 and body["success"] is True
        assert engine_blocks(fleet) == indexed(url, AUTH) == dict.fromkeys(NAMES, 0)


def test_an_engine_holding_blocks_refuses_and_keeps_them(
    fleet: FleetPorts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As vLLM: 200 with success false (callers may retry); the others reset."""
    with serving(fleet.router_config(), monkeypatch) as url, ThreadPoolExecutor(1) as pool:
        running = pool.submit(chat, url, 5000)  # 5 s of decoding
        eventually(lambda: busy(fleet) is not None, what="the request to run")
        holder = busy(fleet)
        assert holder is not None
        eventually(lambda: indexed(url)[holder] > 0, what="the running request's blocks in the index")

        status, body = call(url + "/reset_prefix_cache")
        assert status == 200
        assert body == {"success": False, "instances": {name: name != holder for name in NAMES}}
        assert indexed(url)[holder] > 0 and engine_blocks(fleet)[holder] > 0
        assert running.result()["x-kvroute-instance"] == holder
        assert call(url + "/reset_prefix_cache")[1]["success"] is True


def busy(fleet: FleetPorts) -> str | None:
    """The instance running a request, if one is."""
    running = {
        name: sample(instance_url(fleet, i), "vllm:num_requests_running") for i, name in enumerate(NAMES)
    }
    return next((name for name, count in running.items() if count), None)


def test_engines_that_did_not_reset_are_named(fleet: FleetPorts, monkeypatch: pytest.MonkeyPatch) -> None:
    raw = fleet.router_config()
    instances = cast(list[dict[str, str]], raw["instances"])
    raw["instances"] = [*instances, {"name": "gone", "url": f"http://127.0.0.1:{free_port_block(1)}"}]
    with serving(raw, monkeypatch) as url:
        instance = chat(url)["x-kvroute-instance"]
        in_step(url, fleet, instance)
        status, body = call(url + "/reset_prefix_cache")
        assert status == 502 and body["error"]["code"] == "reset_failed", body
        message = body["error"]["message"]
        assert "failed on 1 of 3 engines (gone: unreachable (ClientConnectorError))" in message
        # Those that answered were reset, and forgotten.
        assert engine_blocks(fleet)[instance] == indexed(url)[instance] == 0

        # The fleet serves no multi-modal or encoder cache reset, as vLLM without VLLM_SERVER_DEV_MODE=1.
        for path in ("/reset_mm_cache", "/reset_encoder_cache"):
            status, body = call(url + path)
            assert status == 502
            for name in NAMES:
                assert (
                    f"{name}: HTTP 404: vLLM serves it only with VLLM_SERVER_DEV_MODE=1"
                    in body["error"]["message"]
                )

        status, body = call(url + "/reset_prefix_cache?reset_running_requests=maybe")
        assert status == 400 and "reset_running_requests" in body["error"]["message"]


def test_an_engine_that_does_not_answer_is_named_after_the_timeout(
    fleet: FleetPorts, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts connections, never answers
        raw = fleet.router_config()
        instances = cast(list[dict[str, str]], raw["instances"])
        url_of_silent = f"http://127.0.0.1:{silent.getsockname()[1]}"
        raw["instances"] = [*instances, {"name": "silent", "url": url_of_silent}]
        with serving(raw, monkeypatch, timeout_s=0.5) as url:
            started = time.monotonic()
            status, body = call(url + "/reset_prefix_cache")
            assert status == 502 and "(silent: no answer within 0.5 s)" in body["error"]["message"], body
            assert time.monotonic() - started < 5
