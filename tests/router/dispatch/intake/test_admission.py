"""Admission control (slots, a bounded queue, 429 with Retry-After) and client API keys."""

from __future__ import annotations

import asyncio
import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvroute.processes import FleetPorts, running_router
from router.dispatch.intake.admission import Admission, Overloaded
from tests.support.http import post

KEYS_ENV = "KVROUTE_TEST_API_KEYS"


def test_slots_then_a_bounded_queue_then_refusals() -> None:
    async def main() -> list[str]:
        admission = Admission(max_in_flight=2, queue_size=1, queue_timeout_s=0.2)
        await admission.enter()
        await admission.enter()
        outcomes = []
        waiter = asyncio.create_task(admission.enter())  # queued
        await asyncio.sleep(0.01)
        try:
            await admission.enter()
        except Overloaded as exc:
            outcomes.append(str(exc))
        try:
            await waiter
        except Overloaded as exc:
            outcomes.append(str(exc))
        queued = asyncio.create_task(admission.enter())
        await asyncio.sleep(0.01)
        admission.leave()  # a slot frees up: the waiting request takes it
        await queued
        outcomes.append(f"admitted, {admission.waiting} waiting, {admission.admitted} in")
        admission.leave()
        admission.leave()
        outcomes.append(f"{admission.admitted} in")
        return outcomes

    # The refused and the timed-out were never in; the queued one came in as one left.
    assert asyncio.run(main()) == ["queue_full", "queue_timeout", "admitted, 0 waiting, 2 in", "0 in"]


def chat(
    url: str,
    max_tokens: int = 2,
    stream: bool = False,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    body = json.dumps(
        {
            "model": "tiny-llama",
            "max_tokens": max_tokens,
            "stream": stream,
            "messages": [{"role": "user", "content": "hi"}],
        }
    ).encode()
    return post(url + "/v1/chat/completions", body, headers)


_ONE_AT_AN_INSTANCE = {
    "requests": {"admission": {"max_in_flight": 4, "max_in_flight_per_instance": 1, "queue_size": 0}},
    # A request waiting for a pooled connection was once taken for an unreachable instance (503), and health
    # checks queued behind the streams marked the instances down.
    "connections": {
        "admission": {"max_in_flight": 4, "queue_size": 0},
        "upstream": {"max_connections_per_instance": 1},
        "health": {"interval_s": 0.2, "timeout_s": 0.5, "unhealthy_after": 1},
    },
}


@pytest.fixture(params=sorted(_ONE_AT_AN_INSTANCE))
def small_router(fleet: FleetPorts, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    config = fleet.router_config(**_ONE_AT_AN_INSTANCE[request.param])
    with running_router(config, tmp_path, name="small") as url:
        yield url


def test_full_instances_and_a_full_router_answer_429_with_retry_after(small_router: str) -> None:
    # The session fleet decodes 1,000 tokens/s: a 1,500-token stream holds its instance for 1.5 s.
    host, port = small_router.removeprefix("http://").split(":")
    body = json.dumps(
        {
            "model": "tiny-llama",
            "max_tokens": 1500,
            "stream": True,
            "messages": [{"role": "user", "content": "a long answer"}],
        }
    )
    streams = []
    for _ in range(3):  # one after another: each is routed (its headers are back) before the next
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        connection.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
        streams.append((connection, connection.getresponse()))
    try:
        assert [response.status for _, response in streams] == [200, 200, 200]
        status, headers, payload = chat(small_router)
        assert status == 429, payload
        error = json.loads(payload)["error"]
        assert error["code"] == "instances_full" and error["type"] == "rate_limit_error"
        assert {k.lower(): v for k, v in headers.items()}["retry-after"] == "1"
        time.sleep(0.6)  # health checks of the busy instances, on connections of their own
        health = json.loads(urllib.request.urlopen(small_router + "/health", timeout=5).read())
        assert len(health["healthy_instances"]) == 3, health
    finally:
        bodies = [response.read() for _, response in streams]
        for connection, _ in streams:
            connection.close()
    assert all(b.rstrip().endswith(b"data: [DONE]") for b in bodies)
    assert chat(small_router)[0] == 200  # capacity is back


@pytest.fixture()
def keyed_router(fleet: FleetPorts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv(KEYS_ENV, "first-client-key, second-client-key")
    with running_router(fleet.router_config(auth={"api_keys_env": KEYS_ENV}), tmp_path, name="keyed") as url:
        yield url


def test_api_keys_are_checked_before_any_work(keyed_router: str) -> None:
    status, headers, payload = chat(keyed_router)
    assert status == 401 and json.loads(payload)["error"]["code"] == "invalid_api_key"
    assert {k.lower(): v for k, v in headers.items()}["www-authenticate"] == "Bearer"
    assert chat(keyed_router, headers={"authorization": "Bearer third-client-key"})[0] == 401
    # Before any work: not even the body is read, so a malformed one is still a 401.
    status, _, _ = post(keyed_router + "/v1/chat/completions", b"{not json", {})
    assert status == 401
    # Nor its type or size: a client without a key learns nothing else about the router.
    assert post(keyed_router + "/v1/completions", b"hi", {"content-type": "text/plain"})[0] == 401
    assert _get(keyed_router + "/v1/models") == 401  # the models served are the clients' business too
    assert _get(keyed_router + "/v1/models", "Bearer first-client-key") == 200
    assert _get(keyed_router + "/health") == 200  # load balancers' probes carry no key
    assert chat(keyed_router, headers={"authorization": "Bearer second-client-key"})[0] == 200


def _get(url: str, authorization: str | None = None) -> int:
    headers = {} if authorization is None else {"authorization": authorization}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return error.code
