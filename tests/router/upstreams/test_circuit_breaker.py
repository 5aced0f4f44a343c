"""The circuit breaker: 5xx, connection errors and timeouts open it; 4xx never do; a probe closes it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from kvroute.processes import FleetPorts, running_router
from router.upstreams.circuit_breaker import CircuitBreaker
from tests.conftest import ManualClock, metric, sample
from tests.support.fake_upstreams import first_in_config, healthy, serving
from tests.support.http import post

BODY = json.dumps({"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}).encode()
ROUND_ROBIN = {"x-kvroute-policy": "round-robin"}


def test_the_breaker_opens_after_consecutive_failures_and_only_its_probe_decides() -> None:
    clock = ManualClock()
    breaker = CircuitBreaker(failures=3, open_s=10, clock=clock)
    assert [breaker.failed(probe=False) for _ in range(2)] == [False, False]
    breaker.succeeded(probe=False)  # a success in between: the count starts again
    assert [breaker.failed(probe=False) for _ in range(3)] == [False, False, True]
    assert not breaker.allows()
    breaker.succeeded(probe=False)  # an answer to a request sent before it opened changes nothing
    assert not breaker.allows()
    clock.now = 10.0  # half-open: one probe at a time
    assert breaker.allows()
    assert breaker.sent()
    assert not breaker.allows()
    assert not breaker.failed(probe=True)  # the probe failed: open again, not newly opened
    assert not breaker.allows()
    clock.now = 20.0
    assert breaker.sent()
    breaker.abandoned(probe=True)  # the probe's client went away (or it was a 4xx): another probe may go
    assert breaker.allows()
    assert breaker.sent()
    clock.now = 30.0  # a probe still running after another open_s no longer holds the slot
    assert breaker.allows()
    breaker.succeeded(probe=True)
    assert breaker.allows() and breaker.opened_at is None
    assert not breaker.sent()  # closed: no probes


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
        assert all(
            status == 200 for status, headers, _ in served if headers["x-kvroute-instance"] != "failing"
        )
        assert metric(url, "kvroute_circuit_open", vllm_instance="failing") == 1
        assert metric(url, "kvroute_circuit_opens_total", vllm_instance="failing") == 1
        assert (
            metric(url, "kvroute_instance_healthy", vllm_instance="failing") == 1
        )  # /health alone says fine


def test_4xx_answers_never_open_the_breaker(
    refusing_upstream: int, fleet: FleetPorts, tmp_path: Path
) -> None:
    with running_router(_router_config(fleet, "refusing", refusing_upstream), tmp_path) as url:
        served = [post(url + "/v1/completions", BODY, ROUND_ROBIN) for _ in range(16)]
        to_refusing = [status for status, headers, _ in served if headers["x-kvroute-instance"] == "refusing"]
        # About every fourth request, all the way through (the exact count depends on the other instances'
        # health on a busy machine).
        assert len(to_refusing) >= 3 and set(to_refusing) == {400}
        # Never touched has no sample yet: that counts as 0.
        assert (sample(url, "kvroute_circuit_opens_total", vllm_instance="refusing") or 0) == 0
        assert (sample(url, "kvroute_circuit_open", vllm_instance="refusing") or 0) == 0
