"""Instances that require a key (vLLM --api-key): the router sends its own, from the environment, and never
the client's; a key variable named but not set is refused before anything starts."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvroute.cli import main
from kvroute.processes import FleetPorts, running_fleet, running_router
from router.config import ConfigError, parse_config
from tests.conftest import sample
from tests.router.dispatch.intake.test_admission import chat
from tests.support.http import post

ENGINE_KEY = "engine-key-0123456789"
ENGINE_KEY_ENV = "KVROUTE_TEST_ENGINE_KEY"
CLIENT_KEYS_ENV = "KVROUTE_TEST_CLIENT_KEYS"


@pytest.fixture(scope="module")
def keyed_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetPorts]:
    ports = FleetPorts.allocate(2)
    with running_fleet(ports, tmp_path_factory.mktemp("keyed-fleet"), ["--api-key", ENGINE_KEY]):
        yield ports


def test_the_simulated_engine_guards_v1_as_vllm_does(keyed_fleet: FleetPorts) -> None:
    url = f"http://127.0.0.1:{keyed_fleet.http}"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url + "/v1/models", timeout=10)
    assert refused.value.code == 401 and json.loads(refused.value.read()) == {"error": "Unauthorized"}
    keyed = urllib.request.Request(url + "/v1/models", headers={"Authorization": f"Bearer {ENGINE_KEY}"})
    assert urllib.request.urlopen(keyed, timeout=10).status == 200
    assert urllib.request.urlopen(url + "/health", timeout=10).status == 200  # unguarded, as in vLLM


def test_the_router_sends_the_instances_key_and_not_the_clients(
    keyed_fleet: FleetPorts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENGINE_KEY_ENV, ENGINE_KEY)
    monkeypatch.setenv(CLIENT_KEYS_ENV, "client-key-0123456789")
    config = keyed_fleet.router_config(
        upstream={"api_key_env": ENGINE_KEY_ENV},
        auth={"api_keys_env": CLIENT_KEYS_ENV},
        default_policy="round-robin",
    )
    served = set()
    with running_router(config, tmp_path) as url:
        for _ in range(4):
            status, headers, payload = chat(url, headers={"authorization": "Bearer client-key-0123456789"})
            assert status == 200, payload
            served.add(headers["x-kvroute-instance"])
        # Anthropic's clients send the key as x-api-key; the engine still gets the router's own Bearer key.
        body = {"model": "tiny-llama", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        for key, expected in (("client-key-0123456789", 200), ("wrong-key-0123456789", 401)):
            status, _, payload = post(
                url + "/v1/messages",
                json.dumps(body).encode(),
                {"x-api-key": key, "anthropic-version": "2023-06-01"},
            )
            assert status == expected, payload
        assert json.loads(payload)["type"] == "error"  # the 401 in Anthropic's shape on its route
    assert served == {"fleet-0", "fleet-1"}


def test_a_request_an_instance_refuses_for_the_key_goes_to_another(
    keyed_fleet: FleetPorts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM checks the key before anything runs: a refusal is as safe to send elsewhere as a refused
    connection. fleet-0 is given the wrong key; every request still succeeds, on fleet-1."""
    monkeypatch.setenv(ENGINE_KEY_ENV, ENGINE_KEY + "\n")  # as mounted from a file: the newline goes
    monkeypatch.setenv("KVROUTE_TEST_WRONG_KEY", "not-the-engine-key")
    config = keyed_fleet.router_config(upstream={"api_key_env": ENGINE_KEY_ENV}, default_policy="round-robin")
    instances = config["instances"]
    assert isinstance(instances, list)
    instances[0]["api_key_env"] = "KVROUTE_TEST_WRONG_KEY"
    with running_router(config, tmp_path) as url:
        answers = [chat(url) for _ in range(4)]
        assert [(status, headers["x-kvroute-instance"]) for status, headers, _ in answers] == [
            (200, "fleet-1")
        ] * 4
        assert {headers["x-kvroute-attempts"] for _, headers, _ in answers} >= {"2"}
        assert sample(url, "kvroute_upstream_errors_total", vllm_instance="fleet-0", kind="unauthorized")


def test_an_engine_refusing_the_routers_credentials_is_a_bad_gateway_not_the_clients_401(
    keyed_fleet: FleetPorts, tmp_path: Path
) -> None:
    """The client's key was fine (clients' keys never reach engines): a 401 would tell it otherwise."""
    with running_router(keyed_fleet.router_config(upstream={"attempts": 1}), tmp_path) as url:
        status, _, payload = chat(url)
        error = json.loads(payload)["error"]
        assert status == 502 and error["code"] == "upstream_unauthorized"
        assert "upstream.api_key_env" in error["message"]
        counted = [
            sample(url, "kvroute_upstream_errors_total", vllm_instance=name, kind="unauthorized") or 0
            for name in ("fleet-0", "fleet-1")
        ]
        assert sum(counted) == 1


def test_an_instances_own_key_variable_wins_and_unset_ones_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    raw = {
        "models": [{"name": "m"}],
        "upstream": {"api_key_env": "FLEET_KEY"},
        "instances": [
            {"name": "a", "url": "http://127.0.0.1:9001"},
            {"name": "b", "url": "http://127.0.0.1:9002", "api_key_env": "B_KEY"},
        ],
    }
    config = parse_config(raw)
    assert [config.api_key_env_of(i) for i in config.instances] == ["FLEET_KEY", "B_KEY"]
    monkeypatch.setenv("FLEET_KEY", "k" * 20)
    monkeypatch.delenv("B_KEY", raising=False)
    with pytest.raises(ConfigError, match=r"key variables are not set: \$B_KEY$"):
        config.require_api_keys("router.yaml")
    monkeypatch.setenv("B_KEY", "b" * 10 + "\n" + "b" * 10)
    with pytest.raises(ConfigError, match=r"\$B_KEY: a key must be printable, on one line"):
        config.require_api_keys("router.yaml")
    monkeypatch.setenv("B_KEY", "b" * 20 + "\n")
    config.require_api_keys("router.yaml")
    unkeyed = parse_config({**raw, "upstream": {}})
    assert [unkeyed.api_key_env_of(i) for i in unkeyed.instances] == [None, "B_KEY"]


def test_serve_and_check_config_refuse_an_unset_key_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("KVROUTE_TEST_UNSET_KEY", raising=False)
    path = tmp_path / "router.yaml"
    path.write_text(
        json.dumps(
            {
                "models": [{"name": "m"}],
                "upstream": {"api_key_env": "KVROUTE_TEST_UNSET_KEY"},
                "instances": [{"name": "a", "url": "http://127.0.0.1:9"}],
            }
        )
    )
    for command in ("check-config", "serve --config"):
        assert main([*command.split(), str(path)]) == 2
        assert "key variables are not set: $KVROUTE_TEST_UNSET_KEY" in capsys.readouterr().err


def test_a_clients_key_variable_without_a_key_is_refused_rather_than_serving_everyone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = parse_config(
        {
            "models": [{"name": "m"}],
            "auth": {"api_keys_env": "CLIENT_KEYS"},
            "instances": [{"name": "a", "url": "http://127.0.0.1:9001"}],
        }
    )
    for unset in (None, "", " , "):
        if unset is None:
            monkeypatch.delenv("CLIENT_KEYS", raising=False)
        else:
            monkeypatch.setenv("CLIENT_KEYS", unset)
        with pytest.raises(ConfigError, match=r"auth.api_keys_env names \$CLIENT_KEYS, which holds no key"):
            config.require_api_keys("router.yaml")
    monkeypatch.setenv("CLIENT_KEYS", "k" * 20)
    config.require_api_keys("router.yaml")
