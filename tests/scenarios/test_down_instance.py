"""An instance that stops (SIGSTOP: no answers, no events) is routed around although the index still holds
its blocks: entries of an instance that is down never count."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvroute.processes import Child, FleetPorts, running_router, start, wait_healthy
from tests.conftest import metric
from tests.support.http import get_json, post

SESSION = " ".join(f"context{i}" for i in range(300))


@pytest.fixture
def two_instances(tmp_path: Path) -> Iterator[tuple[FleetPorts, list[Child]]]:
    ports = FleetPorts.allocate(2)
    children = [
        start(
            f"fleet-{i}",
            ports.instance_args(i),
            tmp_path,
        )
        for i in range(2)
    ]
    try:
        for i, child in enumerate(children):
            wait_healthy(child, [ports.health_urls()[i]])
        yield ports, children
    finally:
        for child in children:
            os.killpg(child.process.pid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            child.stop()


def turn(url: str, text: str) -> tuple[int, dict[str, str]]:
    body = json.dumps({"model": "tiny-llama", "prompt": text, "max_tokens": 2}).encode()
    status, headers, _ = post(url + "/v1/completions", body, {"x-session-id": "down-test"})
    return status, headers


def test_the_blocks_of_a_stopped_instance_do_not_draw_its_session(
    two_instances: tuple[FleetPorts, list[Child]], tmp_path: Path
) -> None:
    ports, children = two_instances
    config = ports.router_config(health={"interval_s": 0.5, "timeout_s": 0.5, "unhealthy_after": 1})
    with running_router(config, tmp_path / "router") as url:
        status, first = turn(url, SESSION)
        assert status == 200
        home = first["x-kvroute-instance"]
        time.sleep(0.5)  # its KV events reach the index
        status, second = turn(url, SESSION + " and a second turn")
        assert status == 200 and second["x-kvroute-instance"] == home
        assert int(second["x-kvroute-cached-blocks"]) > 0  # the index holds the session's prefix there

        stopped = children[int(home.removeprefix("fleet-"))]
        os.killpg(stopped.process.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while metric(url, "kvroute_instance_healthy", vllm_instance=home) != 0:
            assert time.monotonic() < deadline, f"{home} still counted healthy 10 s after it stopped"
            time.sleep(0.1)
        assert metric(url, "kvroute_index_blocks", vllm_instance=home, tier="gpu") > 0  # still indexed
        health = get_json(url + "/health")  # 200: the other instance serves, so balancers keep the router
        assert health["status"] == "degraded" and health["unhealthy_instances"] == [home], health
        assert health["unavailable_models"] == []

        status, third = turn(url, SESSION + " and a second turn and a third")
        assert status == 200  # a request sent to the stopped instance would hang instead
        assert third["x-kvroute-instance"] != home
        assert int(third["x-kvroute-cached-blocks"]) == 0  # nothing of the other's entries counted here
