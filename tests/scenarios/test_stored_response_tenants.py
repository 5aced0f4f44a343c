"""With client keys, a stored response is its creating key's: another key's retrieval, cancellation and
follow-up get the 404 an unknown id gets, through serve (and its second worker), while the creator's work."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvroute.processes import FleetPorts, running_fleet, running_router

CLIENT_KEYS_ENV = "KVROUTE_TEST_TENANT_KEYS"
ALICE, BOB = "alice-key-0123456789", "bob-key-0123456789"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetPorts]:
    ports = FleetPorts.allocate(2)
    with running_fleet(ports, tmp_path_factory.mktemp("fleet"), ["--decode-tps", "5000"]):
        yield ports


def _call(url: str, key: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    """A GET, or a POST of body, with key as an OpenAI client sends it."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    request = urllib.request.Request(url, data, headers, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _created(url: str, key: str) -> str:
    body = {"model": "tiny-llama", "input": "hello", "max_output_tokens": 4, "store": True}
    status, answer = _call(url + "/v1/responses", key, body)
    assert status == 200, answer
    return str(answer["id"])


def _follow_up(url: str, key: str, response_id: str) -> tuple[int, dict[str, Any]]:
    body = {
        "model": "tiny-llama",
        "input": "and?",
        "max_output_tokens": 4,
        "previous_response_id": response_id,
    }
    return _call(url + "/v1/responses", key, body)


def _retrieved(url: str, key: str, response_id: str) -> tuple[int, dict[str, Any]]:
    return _call(url + f"/v1/responses/{response_id}", key)


def _cancelled(url: str, key: str, response_id: str) -> tuple[int, dict[str, Any]]:
    return _call(url + f"/v1/responses/{response_id}/cancel", key, {})


def test_another_keys_requests_on_a_stored_response_are_told_it_does_not_exist(
    fleet: FleetPorts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CLIENT_KEYS_ENV, f"{ALICE},{BOB}")
    config = fleet.router_config(auth={"api_keys_env": CLIENT_KEYS_ENV})
    with running_router(config, tmp_path) as url:
        response_id = _created(url, ALICE)
        unknown = response_id[:-4] + "0000"
        for ask in (_retrieved, _cancelled, _follow_up):
            status, answer = ask(url, BOB, response_id)
            assert status == 404, answer
            assert answer == {
                **ask(url, BOB, unknown)[1],
                "error": {**answer["error"], "message": f"Response with id '{response_id}' not found."},
            }
        assert _retrieved(url, ALICE, response_id)[0] == 200
        status, answer = _follow_up(url, ALICE, response_id)
        assert status == 200, answer
        assert _retrieved(url, BOB, str(answer["id"]))[0] == 404  # the chain stays Alice's


def test_without_client_keys_any_client_reaches_a_stored_response(fleet: FleetPorts, tmp_path: Path) -> None:
    with running_router(fleet.router_config(), tmp_path) as url:
        response_id = _created(url, ALICE)
        assert _retrieved(url, BOB, response_id)[0] == 200
        assert _follow_up(url, BOB, response_id)[0] == 200
