"""Dead instances: routed around while others live, 503 with Retry-After when none can serve."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from aiohttp import web

from kvroute.processes import FleetPorts, free_port_block, running_fleet, running_router
from router.dispatch.place.retry_budget import RetryBudget
from tests.conftest import metric, sample
from tests.support.fake_upstreams import answering, healthy, only_instance, serving, serving_app
from tests.support.http import post

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

BODY = json.dumps({"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}).encode()


def _with_dead_instance(fleet: FleetPorts, dead_port: int, **health: object) -> dict[str, object]:
    config = fleet.router_config(health=health)
    instances = config["instances"]
    assert isinstance(instances, list)
    instances.append({"name": "dead", "url": f"http://127.0.0.1:{dead_port}"})
    return config


@pytest.fixture(scope="module")
def router_with_dead_instance(fleet: FleetPorts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # Active checks effectively off: the dead instance is found by the requests themselves.
    config = _with_dead_instance(fleet, free_port_block(1), interval_s=60, unhealthy_after=100)
    with running_router(config, tmp_path_factory.mktemp("dead-one")) as url:
        yield url


def test_requests_are_routed_around_a_dead_instance(router_with_dead_instance: str) -> None:
    results = [
        post(router_with_dead_instance + "/v1/completions", BODY, {"x-kvroute-policy": "round-robin"})
        for _ in range(8)
    ]
    assert [status for status, _, _ in results] == [200] * 8
    assert {headers["x-kvroute-instance"] for _, headers, _ in results} == {"fleet-0", "fleet-1", "fleet-2"}
    assert (
        metric(
            router_with_dead_instance, "kvroute_upstream_errors_total", vllm_instance="dead", kind="connect"
        )
        >= 1
    )
    assert metric(router_with_dead_instance, "kvroute_instance_healthy", vllm_instance="dead") == 0


@pytest.mark.parametrize("unhealthy_after", [1, 100])
def test_no_reachable_instance_is_a_503_with_retry_after(tmp_path: Path, unhealthy_after: int) -> None:
    # 1: health checks find every instance down first; 100: the request itself finds them unreachable.
    dead = free_port_block(3)
    config = {
        "models": [{"name": "tiny-llama", "tokenizer": "builtin:tiny-llama"}],  # fakes: no root
        "instances": [{"name": f"gone-{i}", "url": f"http://127.0.0.1:{dead + i}"} for i in range(3)],
        "health": {"interval_s": 60, "unhealthy_after": unhealthy_after},
    }
    with running_router(config, tmp_path) as url:
        for _ in range(3):
            status, headers, payload = post(url + "/v1/completions", BODY)
            assert status == 503
            assert int(headers["retry-after"]) >= 1
            error = json.loads(payload)["error"]
            assert error["type"] == "service_unavailable_error"
            assert error["code"] in ("no_healthy_instance", "upstream_unreachable")
        try:
            urllib.request.urlopen(url + "/health", timeout=10).close()
            pytest.fail("/health answered 200 with every instance down")
        except urllib.error.HTTPError as error:
            assert error.code == 503
            health = json.loads(error.read())
            assert health["status"] == "unavailable" and health["healthy_instances"] == []
            assert health["unavailable_models"] == ["tiny-llama"]


def test_an_instance_that_comes_up_later_is_taken_back(tmp_path: Path) -> None:
    ports = FleetPorts.allocate(1)
    config = ports.router_config(health={"interval_s": 20, "unhealthy_after": 1})
    with running_router(config, tmp_path / "router") as url:
        status, _, _ = post(url + "/v1/completions", BODY)
        assert status == 503  # nothing listens yet
        with running_fleet(ports, tmp_path / "fleet"):
            # Down instances are probed every 0.5 s although healthy ones wait 20 s between checks.
            for _ in range(30):
                if metric(url, "kvroute_instance_healthy", vllm_instance="fleet-0") == 1:
                    break
                time.sleep(0.1)
            status, headers, _ = post(url + "/v1/completions", BODY)
            assert status == 200
            assert headers["x-kvroute-instance"] == "fleet-0"


@pytest.fixture
def breaking_upstream() -> Iterator[int]:
    """An instance that answers /health but breaks every completion off after its headers."""

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def broken(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": "1000"})
        await response.prepare(request)
        await response.write(b'{"id": "cut')
        assert request.transport is not None
        request.transport.close()
        return response

    with serving(health, broken) as port:
        yield port


def test_an_answer_that_breaks_off_with_no_other_instance_is_a_502_in_openai_shape(
    breaking_upstream: int, tmp_path: Path
) -> None:
    config = only_instance("flaky", breaking_upstream)
    with running_router(config, tmp_path) as url:
        status, _, payload = post(url + "/v1/completions", BODY)
        assert status == 502
        assert json.loads(payload)["error"]["code"] == "upstream_failed"
        assert metric(url, "kvroute_upstream_errors_total", vllm_instance="flaky", kind="disconnected") == 1
        assert metric(url, "kvroute_instance_in_flight", vllm_instance="flaky") == 0


async def _drop(request: web.Request) -> web.Response:
    """Closes the connection unanswered, as an engine that dies while prefilling does."""
    await request.read()
    assert request.transport is not None
    request.transport.close()
    return web.Response()


@pytest.fixture
def dropping_upstream() -> Iterator[int]:
    """An instance that answers /health but drops every completion."""
    with serving(healthy, _drop) as port:
        yield port


def test_a_request_dropped_unanswered_is_served_by_another_instance(
    dropping_upstream: int, fleet: FleetPorts, tmp_path: Path
) -> None:
    config = fleet.router_config()
    config["instances"] = [
        {"name": "dropper", "url": f"http://127.0.0.1:{dropping_upstream}"},
        config["instances"][0],
    ]
    with running_router(config, tmp_path) as url:
        body = json.dumps({"model": "tiny-llama", "prompt": "hello", "max_tokens": 2}).encode()
        served = []
        for _ in range(6):  # round robin: every other request goes to the dropper first
            status, headers, payload = post(
                url + "/v1/completions", body, {"x-kvroute-policy": "round-robin"}
            )
            assert status == 200, payload
            served.append(headers["x-kvroute-instance"])
            time.sleep(0.6)  # the dropper answers /health, so it is taken back between requests
        assert set(served) == {"fleet-0"}
        assert metric(url, "kvroute_retries_total", vllm_instance="dropper") >= 1
        assert metric(url, "kvroute_upstream_errors_total", vllm_instance="dropper", kind="disconnected") >= 1


def test_the_retry_budget_is_a_share_of_the_traffic() -> None:
    budget = RetryBudget(ratio=0.25, burst=2)
    assert [budget.spend() for _ in range(3)] == [True, True, False]
    for _ in range(4):
        budget.earn()
    assert [budget.spend() for _ in range(2)] == [True, False]


@pytest.fixture
def never_accepting_port() -> Iterator[int]:
    """A port whose listen backlog is full and never drained: connecting to it neither fails nor succeeds."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))  # the kernel's pick: a checked-free port may still be in TIME_WAIT here
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(3):  # whatever the kernel queues beyond backlog 0, later SYNs are dropped
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        fillers.append(filler)
    try:
        yield port
    finally:
        for sock in (*fillers, listener):
            sock.close()


def test_an_instance_that_never_accepts_is_a_connect_failure_served_elsewhere(
    never_accepting_port: int, fleet: FleetPorts, tmp_path: Path
) -> None:
    config = fleet.router_config(health={"interval_s": 60, "unhealthy_after": 100})
    config["upstream"] = {"connect_timeout_s": 0.3}
    config["instances"] = [
        {"name": "stuck", "url": f"http://127.0.0.1:{never_accepting_port}"},
        config["instances"][0],
    ]
    with running_router(config, tmp_path) as url:
        for _ in range(4):
            status, headers, payload = post(
                url + "/v1/completions", BODY, {"x-kvroute-policy": "round-robin"}
            )
            assert status == 200, payload
            assert headers["x-kvroute-instance"] == "fleet-0"
        assert metric(url, "kvroute_upstream_errors_total", vllm_instance="stuck", kind="connect") >= 1
        assert sample(url, "kvroute_upstream_errors_total", vllm_instance="stuck", kind="timeout") is None
        assert metric(url, "kvroute_instance_healthy", vllm_instance="stuck") == 0


@pytest.mark.parametrize(
    ("status", "content_type", "answer", "passed_as_is"),
    [
        (500, "text/html", b"<html>Internal Server Error</html>", False),
        (404, "text/plain", b"404: Not Found", False),
        (400, "application/json", b'{"detail": "not OpenAI"}', False),
        (
            400,
            "application/json",
            b'{"error": {"message": "too long", "type": "x", "param": null, "code": 400}}',
            True,
        ),
    ],
)
def test_an_upstream_error_reaches_the_client_in_openai_shape(
    status: int, content_type: str, answer: bytes, passed_as_is: bool, tmp_path: Path
) -> None:
    async def fail(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(status=status, body=answer, content_type=content_type)

    with serving(healthy, fail) as port:
        config = only_instance("odd", port)
        with running_router(config, tmp_path) as url:
            got_status, headers, payload = post(url + "/v1/completions", BODY)
    assert got_status == status
    assert headers["content-type"] == "application/json"
    error = json.loads(payload)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if passed_as_is:
        assert payload == answer
    else:
        assert answer.decode() in error["message"]


@pytest.mark.parametrize("status", [429, 503])
def test_an_upstreams_retry_after_reaches_the_client(status: int, tmp_path: Path) -> None:
    async def busy(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(status=status, body=b'{"detail": "busy"}', headers={"Retry-After": "7"})

    with serving(healthy, busy) as port, running_router(only_instance("busy", port), tmp_path) as url:
        got_status, headers, _ = post(url + "/v1/completions", BODY)
    assert (got_status, headers["retry-after"]) == (status, "7")


async def _queue_full(request: web.Request) -> web.Response:
    """vLLM's answer past --max-num-queued-reqs: a 503 before any work, asking for another instance."""
    await request.read()
    error = {
        "message": "The engine is currently busy and cannot accept new requests. Please try again later "
        "or on a different instance.",
        "type": "Service Unavailable",
        "param": None,
        "code": 503,
    }
    return web.json_response({"error": error}, status=503, headers={"Retry-After": "3"})


def _two_instances(first: int, second: int) -> dict[str, object]:
    return {
        "models": [{"name": "tiny-llama", "tokenizer": "builtin:tiny-llama"}],  # fakes: no root
        "instances": [
            {"name": f"i{n}", "url": f"http://127.0.0.1:{port}"} for n, port in enumerate((first, second))
        ],
        "circuit_breaker": {"failures": 2},
    }


def test_a_busy_instances_503_is_served_by_another_instance(tmp_path: Path) -> None:
    with serving(healthy, _queue_full) as busy, serving(healthy, answering) as free:
        with running_router(_two_instances(busy, free), tmp_path) as url:
            attempts = []
            for _ in range(6):  # round robin: every other request tries the busy one first
                status, headers, payload = post(
                    url + "/v1/completions", BODY, {"x-kvroute-policy": "round-robin"}
                )
                assert (status, headers["x-kvroute-instance"]) == (200, "i1"), payload
                attempts.append(headers["x-kvroute-attempts"])
            assert sorted(set(attempts)) == ["1", "2"]
            assert metric(url, "kvroute_upstream_errors_total", vllm_instance="i0", kind="busy") >= 2
            # Busy is not broken: two failures in a row would have opened its breaker.
            assert sample(url, "kvroute_circuit_opens_total", vllm_instance="i0") in (None, 0)


def test_when_every_instance_is_busy_the_last_503_reaches_the_client(tmp_path: Path) -> None:
    with serving(healthy, _queue_full) as first, serving(healthy, _queue_full) as second:
        with running_router(_two_instances(first, second), tmp_path) as url:
            for _ in range(3):
                status, headers, payload = post(url + "/v1/completions", BODY)
                assert (status, headers["retry-after"], headers["x-kvroute-attempts"]) == (503, "3", "2")
                assert "different instance" in json.loads(payload)["error"]["message"]
            assert sample(url, "kvroute_circuit_opens_total", vllm_instance="i0") in (None, 0)
            assert sample(url, "kvroute_circuit_opens_total", vllm_instance="i1") in (None, 0)


def test_an_instance_that_answers_a_redirect_is_not_followed(tmp_path: Path) -> None:
    """A redirect leads to no instance the router knows (and a 302 would turn the POST into a GET): the
    request goes to another instance; with none left, a 502 that names where the redirect led."""
    followed: list[str] = []

    async def moved(request: web.Request) -> web.Response:
        await request.read()
        raise web.HTTPTemporaryRedirect("/elsewhere")

    async def elsewhere(request: web.Request) -> web.Response:
        followed.append(request.method)
        return web.json_response({"choices": [{"text": "from elsewhere"}]})

    app = web.Application()
    app.router.add_get("/health", healthy)
    app.router.add_post("/v1/completions", moved)
    app.router.add_route("*", "/elsewhere", elsewhere)
    with serving_app(app) as redirecting, serving(healthy, answering) as plain:
        with running_router(_two_instances(redirecting, plain), tmp_path) as url:
            for _ in range(4):  # round robin: every other request tries the redirecting one first
                status, headers, payload = post(
                    url + "/v1/completions", BODY, {"x-kvroute-policy": "round-robin"}
                )
                assert (status, headers["x-kvroute-instance"]) == (200, "i1"), payload
            assert metric(url, "kvroute_upstream_errors_total", vllm_instance="i0", kind="redirect") >= 2
        with running_router(only_instance("i0", redirecting), tmp_path) as url:
            status, headers, payload = post(url + "/v1/completions", BODY)
    assert followed == []
    assert status == 502
    error = json.loads(payload)["error"]
    assert error["code"] == "upstream_redirected" and "/elsewhere" in error["message"]


def test_a_client_that_leaves_before_its_answer_frees_the_instance_at_once(tmp_path: Path) -> None:
    """A whole answer that takes 10 s: the client hangs up after 0.5 s, and the router must close the
    upstream request then (so the engine aborts it), not when the answer would have come."""
    noticed: list[float] = []

    async def slow(request: web.Request) -> web.Response:
        await request.read()
        for _ in range(100):
            if request.transport is None or request.transport.is_closing():
                noticed.append(time.monotonic())
                break
            await asyncio.sleep(0.1)
        return web.json_response({"choices": []})

    with serving(healthy, slow) as port:
        config = only_instance("slow", port)
        with running_router(config, tmp_path) as url:
            host, router_port = url.removeprefix("http://").split(":")
            client = socket.create_connection((host, int(router_port)))
            client.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(BODY)}\r\n\r\n".encode()
                + BODY
            )
            time.sleep(0.5)
            assert metric(url, "kvroute_instance_in_flight", vllm_instance="slow") == 1
            left = time.monotonic()
            client.close()
            deadline = left + 3
            while not noticed and time.monotonic() < deadline:
                time.sleep(0.05)
            assert noticed, "the upstream request stayed open after the client left"
            assert noticed[0] - left < 2
            assert metric(url, "kvroute_instance_in_flight", vllm_instance="slow") == 0
            assert metric(url, "kvroute_client_errors_total", code="client_closed") == 1


def test_a_client_that_leaves_while_sending_its_body_is_counted_not_a_server_error(tmp_path: Path) -> None:
    async def answer(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"text": "ok"}]})

    with serving(healthy, answer) as port, running_router(only_instance("i0", port), tmp_path) as url:
        host, router_port = url.removeprefix("http://").split(":")
        client = socket.create_connection((host, int(router_port)))
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(BODY) + 100}\r\n\r\n".encode()
            + BODY  # 100 bytes short
        )
        time.sleep(0.3)
        client.close()
        deadline = time.monotonic() + 3
        while sample(url, "kvroute_client_errors_total", code="client_closed") != 1:
            assert time.monotonic() < deadline, "the disconnect was not counted as the client's"
            time.sleep(0.05)
        assert post(url + "/v1/completions", BODY, {})[0] == 200  # its admission slot is back


def test_a_request_every_instance_drops_does_not_take_the_model_down(tmp_path: Path) -> None:
    async def picky(request: web.Request) -> web.Response:
        if b"poison" in await request.read():
            assert request.transport is not None
            request.transport.close()
        return web.json_response({"choices": [{"text": "ok"}]})

    with serving(healthy, picky) as first, serving(healthy, picky) as second:
        config = {
            "models": [{"name": "tiny-llama", "tokenizer": "builtin:tiny-llama"}],  # fakes: no root
            "instances": [
                {"name": f"i{n}", "url": f"http://127.0.0.1:{port}"} for n, port in enumerate((first, second))
            ],
            "health": {"interval_s": 60},
        }
        with running_router(config, tmp_path) as url:
            poison = json.dumps({"model": "tiny-llama", "prompt": "poison", "max_tokens": 1}).encode()
            status, _, payload = post(url + "/v1/completions", poison)
            assert status == 502, payload
            status, _, payload = post(url + "/v1/completions", BODY)
            assert status == 200, payload
            assert metric(url, "kvroute_instance_healthy", vllm_instance="i0") == 1
            assert metric(url, "kvroute_instance_healthy", vllm_instance="i1") == 1


def test_an_upstream_error_nested_past_the_decoders_depth_still_ends_the_request(tmp_path: Path) -> None:
    nested = b'{"error": {"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}"

    async def fail(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(status=500, body=nested, content_type="application/json")

    with serving(healthy, fail) as port:
        config = only_instance("deep", port)
        with running_router(config, tmp_path) as url:
            status, _, payload = post(url + "/v1/completions", BODY)
            assert status == 500
            assert set(json.loads(payload)["error"]) == {"message", "type", "param", "code"}
            assert metric(url, "kvroute_instance_in_flight", vllm_instance="deep") == 0


def test_a_request_every_instance_drops_is_retried_once_per_other_instance(tmp_path: Path) -> None:
    """A retry is spent only when another instance is left to try: twelve requests that both instances drop
    are each retried once, well within the budget (10 + 0.2 a request), and counted once."""
    with serving(healthy, _drop) as first, serving(healthy, _drop) as second:
        with running_router(_two_instances(first, second), tmp_path) as url:
            for _ in range(12):
                status, headers, payload = post(url + "/v1/completions", BODY, {"x-request-id": "dropped"})
                assert status == 502 and json.loads(payload)["error"]["code"] == "upstream_failed", payload
                assert headers["x-kvroute-attempts"] == "2" and headers["x-request-id"] == "dropped"
            # Counted on the instance that failed first: one of them may have failed every first attempt.
            retries = [sample(url, "kvroute_retries_total", vllm_instance=i) for i in ("i0", "i1")]
            assert sum(n or 0.0 for n in retries) == 12
