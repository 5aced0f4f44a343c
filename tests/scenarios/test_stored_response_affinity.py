"""Stored responses across routers: a `previous_response_id` chain whose turns go through two replicas, one
of them `serve --workers 2`, each turn on a new connection, and through a replica restarted mid-chain, stays
on the instance that holds its responses: the id names it, so no router needs to have seen the chain."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kvroute.processes import Child, FleetPorts, free_port_block, running_fleet, start, wait_healthy

INSTANCE = "x-kvroute-instance"


def _post(url: str, body: dict[str, object]) -> tuple[int, dict[str, str], dict[str, object]]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:  # a new connection every time
            return answer.status, dict(answer.headers), json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json.loads(error.read())


def _router(config: Path, port: int, log_dir: Path, name: str, *args: str) -> Child:
    child = start(name, ["serve", "--config", str(config), "--port", str(port), *args], log_dir)
    wait_healthy(child, [f"http://127.0.0.1:{port}/metrics"])
    return child


@pytest.fixture(scope="module")
def fleet(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetPorts]:
    ports = FleetPorts.allocate(3)
    with running_fleet(ports, tmp_path_factory.mktemp("fleet"), ["--decode-tps", "5000"]):
        yield ports


def test_a_chain_through_replicas_workers_and_a_restart_stays_on_its_instance(
    fleet: FleetPorts, tmp_path: Path
) -> None:
    config = tmp_path / "router.yaml"
    config.write_text(yaml.safe_dump(fleet.router_config()))
    base = free_port_block(2)
    ports = [base, base + 1]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    workers = _router(config, ports[0], tmp_path, "workers", "--workers", "2")
    replica = _router(config, ports[1], tmp_path, "replica")
    try:
        previous: str | None = None
        served: list[str] = []
        for turn in range(8):
            if turn == 5:  # a restarted replica has never seen the chain
                replica.stop()
                replica = _router(config, ports[1], tmp_path, "replica-again")
            body: dict[str, object] = {
                "input": f"turn {turn}: go on with the refactor",
                "max_output_tokens": 4,
            }
            if previous is not None:
                body["previous_response_id"] = previous
            status, headers, response = _post(urls[turn % 2] + "/v1/responses", body)
            assert status == 200, response
            served.append(headers[INSTANCE])
            previous = str(response["id"])
        assert len(set(served)) == 1, served
        with urllib.request.urlopen(f"{urls[1]}/v1/responses/{previous}", timeout=30) as answer:
            assert answer.headers[INSTANCE] == served[0]
            assert json.loads(answer.read())["id"] == previous
        status, headers, refused = _post(f"{urls[0]}/v1/responses/{previous}/cancel", {})
        assert (status, headers[INSTANCE]) == (400, served[0])  # vLLM's: it is not a background response
        assert refused["error"]["message"] == "Cannot cancel a synchronous response."
    finally:
        replica.stop()
        workers.stop()
