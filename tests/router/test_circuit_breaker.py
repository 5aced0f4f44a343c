"""The circuit breaker: 5xx, connection errors and timeouts open it; 4xx never do; a probe closes it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from kvroute.processes import FleetPorts, running_router
from router.circuit_breaker import CircuitBreaker
from tests.conftest import metric
from tests.router.fake_upstreams import first_in_config, healthy, serving
from tests.router.test_proxy import post

BODY = json.dumps({"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}).encode()
ROUND_ROBIN = {"x-kvroute-policy": "round-robin"}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_breaker_opens_after_consecutive_failures_and_one_probe_decides() -> None:
    clock = Clock()
    breaker = CircuitBreaker(failures=3, open_s=10, clock=clock)
    assert [breaker.failed() for _ in range(2)] == [False, False]
    breaker.succeeded()  # a success in between: the count starts again
    assert [breaker.failed() for _ in range(3)] == [False, False, True]
    assert not breaker.allows()
    clock.now = 10.0  # half-open: one probe at a time
    assert breaker.allows()
    breaker.sent()
    assert not breaker.allows()
    assert not breaker.failed()  # the probe failed: open again, not newly opened
    assert not breaker.allows()
    clock.now = 20.0
    breaker.sent()
    breaker.abandoned()  # the probe's client went away: another probe may go
    assert breaker.allows()
    breaker.sent()
    breaker.succeeded()
    assert breaker.allows() and breaker.opened_at is None


def _answering(status: int) -> Iterator[int]:
    async def answer(request: web.Request) -> web.Response:
        await request.read()
        error = {"error": {"message": "no", "type": "x", "param": None, "code": status}}
        return web.json_response(error, status=status)

    with serving(healthy, answer) as port:
        yield port


@pytest.fixture
def failing_upstream() -> Iterator[int]:
    """Healthy to /health, 500 to every request: only the requests themselves show it is broken."""
    yield from _answering(500)


@pytest.fixture
def refusing_upstream() -> Iterator[int]:
    """Healthy, and 400 to every request, as an engine answers a prompt over its context."""
    yield from _answering(400)


def _router_config(fleet: FleetPorts, name: str, port: int) -> dict[str, object]:
    return first_in_config(fleet, name, port, circuit_breaker={"failures": 3, "open_s": 60})


def test_an_instance_answering_5xx_is_cut_off_after_consecutive_failures(
    failing_upstream: int, fleet: FleetPorts, tmp_path: Path
) -> None:
    with running_router(_router_config(fleet, "failing", failing_upstream), tmp_path) as url:
        served = [post(url + "/v1/completions", BODY, ROUND_ROBIN) for _ in range(16)]
        to_failing = [status for status, headers, _ in served if headers["x-kvroute-instance"] == "failing"]
        assert to_failing == [500, 500, 500]  # relayed as they came, then no more requests go there
        assert all(status == 200 for status, headers, _ in served if headers["x-kvroute-instance"] != "failing")
        assert metric(url, "kvroute_circuit_open", instance="failing") == 1
        assert metric(url, "kvroute_circuit_opens_total", instance="failing") == 1
        assert metric(url, "kvroute_instance_healthy", instance="failing") == 1  # /health alone says fine


def test_4xx_answers_never_open_the_breaker(refusing_upstream: int, fleet: FleetPorts, tmp_path: Path) -> None:
    with running_router(_router_config(fleet, "refusing", refusing_upstream), tmp_path) as url:
        served = [post(url + "/v1/completions", BODY, ROUND_ROBIN) for _ in range(16)]
        to_refusing = [status for status, headers, _ in served if headers["x-kvroute-instance"] == "refusing"]
        assert to_refusing == [400] * 4  # every fourth request, all the way through
        assert metric(url, "kvroute_circuit_open", instance="refusing") == 0
