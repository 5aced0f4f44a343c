"""Two router processes in front of one fleet, sharing a redis-server: each counts the other's requests in
flight, its own limits stay its own, and a router that stops drops out of the other's count."""

from __future__ import annotations

import contextlib
import http.client
import json
import urllib.request
from pathlib import Path

from kvroute.processes import FleetPorts, running_router
from kvroute.store_servers import running_redis
from tests.conftest import sample
from tests.support.waiting import eventually


def _in_flight(url: str) -> int:
    """Requests in flight on the fleet's instances as this router counts them (its own and its peers')."""
    with urllib.request.urlopen(url + "/dashboard/state", timeout=10) as response:
        return sum(instance["in_flight"] for instance in json.loads(response.read())["instances"])


def _stream(url: str) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A chat stream that holds its instance for ~4 s (the session fleet decodes 1,000 tokens a second)."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(
        {
            "model": "tiny-llama",
            "max_tokens": 4000,
            "stream": True,
            "messages": [{"role": "user", "content": "a long answer"}],
        }
    )
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    return connection, connection.getresponse()


def test_routers_count_each_others_requests_and_forget_one_that_stops(
    fleet: FleetPorts, tmp_path: Path
) -> None:
    settings = {
        "admission": {"max_in_flight_per_instance": 1},  # each router's own requests
        "health": {"interval_s": 0.2},
    }
    with contextlib.ExitStack() as routers:
        store = routers.enter_context(running_redis(tmp_path / "redis"))
        shared = {"url": store.url, "interval_s": 0.05, "stale_after_s": 0.5}
        config = fleet.router_config(shared=shared, **settings)
        second_url = routers.enter_context(running_router(config, tmp_path, "second"))
        with running_router(config, tmp_path, "first") as first_url:
            for url in (first_url, second_url):
                eventually(lambda url=url: sample(url, "kvroute_peer_routers") == 1)  # type: ignore[misc]
            streams = [_stream(first_url) for _ in range(3)]  # one on each instance, through the first
            try:
                assert [response.status for _, response in streams] == [200, 200, 200]
                eventually(lambda: _in_flight(second_url) == 3)  # the second hears of all three
                # Its limit counts its own requests: the instances are full for the first router only.
                refused, answer = _stream(first_url)
                assert answer.status == 429
                refused.close()
                connection, response = _stream(second_url)
                assert response.status == 200
                streams.append((connection, response))
            finally:
                bodies = [response.read() for _, response in streams]
                for connection, _ in streams:
                    connection.close()
            assert all(body.rstrip().endswith(b"data: [DONE]") for body in bodies)
            assert sample(second_url, "kvroute_peer_snapshots_total", result="malformed") in (None, 0.0)
            eventually(lambda: _in_flight(second_url) == 0)
        eventually(lambda: sample(second_url, "kvroute_peer_routers") == 0)
