"""The operator's API on a running router: auth, A/B results, the split at runtime, reloads good and bad
(by request and by editing the file), and instances removed while requests are in flight."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvroute.processes import FleetPorts, running_router
from router.config import parse_config
from router.dispatch.intake.routing_table import RoutingTable
from router.http.admin import admin_token
from router.http.settings import AdminConfig
from router.reload import Reloader
from router.runtime import Runtime
from tests.conftest import metric, sample
from tests.support.http import post
from tests.support.waiting import eventually

TOKEN = "test-admin-token-0123456789"
AUTH = {"authorization": f"Bearer {TOKEN}"}
RAW: dict[str, Any] = {
    "models": [{"name": "tiny-llama"}],
    "instances": [{"name": "a", "url": "http://127.0.0.1:9"}],
}


def config_of(fleet: FleetPorts, **extra: Any) -> dict[str, Any]:
    return fleet.router_config(
        admin={"token": TOKEN}, traffic={"split": {"round-robin": 50, "kvroute": 50}}, **extra
    )


@pytest.fixture()
def admin_router(fleet: FleetPorts, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    with running_router(config_of(fleet), tmp_path, name="admin") as url:
        yield url, tmp_path / "admin.yaml"


def call(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method=method, headers={"content-type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def chat(
    url: str, session: str, headers: dict[str, str] | None = None, stream: bool = False
) -> dict[str, str]:
    body = json.dumps(
        {
            "model": "tiny-llama",
            "max_tokens": 2,
            "stream": stream,
            "messages": [{"role": "user", "content": f"hello from {session}"}],
        }
    ).encode()
    status, response_headers, payload = post(
        url + "/v1/chat/completions", body, {"x-session-id": session, **(headers or {})}
    )
    assert status == 200, payload
    return {k.lower(): v for k, v in response_headers.items()}


def test_admin_routes_need_the_token(admin_router: tuple[str, Path]) -> None:
    url, _ = admin_router
    assert call("GET", url + "/admin/ab")[0] == 401
    status, body = call("GET", url + "/admin/ab", headers={"authorization": "Bearer wrong-token-0000000000"})
    assert status == 403 and body["error"]["code"] == "wrong_token"
    assert call("POST", url + "/admin/reload", headers={"authorization": "Basic x"})[0] == 401
    assert call("GET", url + "/admin/ab", headers=AUTH)[0] == 200
    # Counted, so that probing can be alerted on.
    assert sample(url, "kvroute_client_errors_total", code="missing_token") == 2
    assert sample(url, "kvroute_client_errors_total", code="wrong_token") == 1


def test_without_a_token_the_admin_routes_are_off(router_url: str) -> None:
    assert call("GET", router_url + "/admin/ab", headers=AUTH)[0] == 404


def test_sessions_follow_the_split_and_the_header_forces_a_policy(admin_router: tuple[str, Path]) -> None:
    url, _ = admin_router
    seen = {f"s{i}": chat(url, f"s{i}")["x-kvroute-policy"] for i in range(40)}
    assert set(seen.values()) == {"round-robin", "kvroute"}
    assert all(chat(url, s)["x-kvroute-policy"] == policy for s, policy in list(seen.items())[:10])  # sticky
    assert chat(url, "s0", {"x-kvroute-policy": "precise-prefix"})["x-kvroute-policy"] == "precise-prefix"

    status, body = call("GET", url + "/admin/ab", headers=AUTH)
    assert status == 200
    counts = Counter(seen.values()) + Counter(seen[s] for s in list(seen)[:10])
    for policy in ("round-robin", "kvroute"):
        results = body["policies"][policy]
        assert results["requests"] == counts[policy]
        assert results["errors"] == results["rejected"] == 0
        assert results["ttft_ms"]["p50"] is not None
        assert sum(results["requests_per_instance"].values()) == counts[policy]
    assert body["policies"]["precise-prefix"]["requests"] == 1
    assert body["split"] == {"round-robin": 0.5, "kvroute": 0.5, "precise-prefix": 0.0}
    assert body["comparisons"][0]["baseline"] == "round-robin"
    assert "verdict" in body["comparisons"][0]
    # TTFTs are kept with their session: the repeated ten count once
    assert body["comparisons"][0]["sessions"] == [
        Counter(seen.values())[p] for p in ("round-robin", "kvroute")
    ]


def test_the_split_changes_at_runtime(admin_router: tuple[str, Path]) -> None:
    url, _ = admin_router
    assert call("PUT", url + "/admin/traffic", {"split": {"round-robin": 0, "kvroute": 100}}, AUTH) == (
        200,
        {"split": {"round-robin": 0.0, "kvroute": 1.0}},
    )
    assert {chat(url, f"t{i}")["x-kvroute-policy"] for i in range(20)} == {"kvroute"}
    assert call("GET", url + "/admin/traffic", headers=AUTH) == (
        200,
        {"split": {"round-robin": 0.0, "kvroute": 1.0}},
    )
    status, body = call("PUT", url + "/admin/traffic", {"split": {"nope": 1}}, AUTH)
    assert status == 400 and "Unknown policies ['nope']" in body["error"]["message"]
    assert call("PUT", url + "/admin/traffic", {"split": {"kvroute": -1}}, AUTH)[0] == 400
    bad_key = urllib.request.Request(
        url + "/admin/traffic",
        data=b'{"split": {"\xff": 1}}',
        method="PUT",
        headers={"content-type": "application/json", **AUTH},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:  # not UTF-8: a 400 in OpenAI's shape, not a 500
        urllib.request.urlopen(bad_key, timeout=30)
    assert refused.value.code == 400 and "The body must be" in json.load(refused.value)["error"]["message"]


def test_a_bad_file_is_refused_and_the_running_config_stays(
    admin_router: tuple[str, Path], fleet: FleetPorts
) -> None:
    url, path = admin_router
    path.write_text("policies: [not, a, mapping")
    status, body = call("POST", url + "/admin/reload", headers=AUTH)
    assert status == 400 and "not valid YAML" in body["error"]["message"]
    path.write_bytes(b"block_size: \xff")
    status, body = call("POST", url + "/admin/reload", headers=AUTH)
    assert status == 400 and "not UTF-8 text" in body["error"]["message"]
    path.write_text(yaml.safe_dump(config_of(fleet, block_size=16)))
    status, body = call("POST", url + "/admin/reload", headers=AUTH)
    assert status == 400 and "changing block_size needs a restart" in body["error"]["message"]
    assert metric(url, "kvroute_config_reloads_total", result="invalid") >= 3
    assert {chat(url, f"b{i}")["x-kvroute-policy"] for i in range(20)} == {"round-robin", "kvroute"}


def test_a_good_file_is_taken_over_on_request_and_on_change(
    admin_router: tuple[str, Path], fleet: FleetPorts
) -> None:
    url, path = admin_router
    fast = {"scorers": [{"type": "ttft-cost"}]}
    config = config_of(fleet)
    config["policies"] = {
        "kvroute": fast,
        "round-robin": {"scorers": [{"type": "round-robin"}]},
        "fast": fast,
    }
    config["traffic"] = {"split": {"fast": 1}}
    path.write_text(yaml.safe_dump(config))
    status, body = call("POST", url + "/admin/reload", headers=AUTH)
    assert status == 200 and body["split"] == {"fast": 1.0}
    assert chat(url, "g1")["x-kvroute-policy"] == "fast"
    config["traffic"] = {"split": {"round-robin": 1}}
    path.write_text(yaml.safe_dump(config))  # no request: the router watches its file
    eventually(
        lambda: chat(url, "g2")["x-kvroute-policy"] == "round-robin", what="the edited file to take effect"
    )
    assert metric(url, "kvroute_config_reloads_total", result="ok") >= 2


def test_removed_instances_finish_what_they_have_and_get_nothing_new(
    admin_router: tuple[str, Path], fleet: FleetPorts
) -> None:
    url, path = admin_router
    config = config_of(fleet)

    def stream(i: int) -> tuple[str, bytes]:
        body = json.dumps(
            {
                "model": "tiny-llama",
                "max_tokens": 200,
                "stream": True,
                "messages": [{"role": "user", "content": f"long answer {i}"}],
            }
        ).encode()
        status, headers, payload = post(
            url + "/v1/chat/completions", body, {"x-kvroute-policy": "round-robin"}
        )
        assert status == 200
        return headers["x-kvroute-instance"], payload

    with ThreadPoolExecutor(6) as pool:
        streams = [pool.submit(stream, i) for i in range(6)]
        time.sleep(0.3)  # all in flight, two on each instance
        config["instances"] = config["instances"][:2]
        path.write_text(yaml.safe_dump(config))
        status, body = call("POST", url + "/admin/reload", headers=AUTH)
        assert status == 200 and body["removed"] == ["fleet-2"]
        results = [s.result() for s in streams]
    assert "fleet-2" in {instance for instance, _ in results}  # it was serving when it was removed
    assert all(payload.rstrip().endswith(b"data: [DONE]") for _, payload in results)
    assert {
        chat(url, f"r{i}", {"x-kvroute-policy": "round-robin"})["x-kvroute-instance"] for i in range(12)
    } == {"fleet-0", "fleet-1"}
    eventually(
        lambda: metric(url, "kvroute_index_blocks", vllm_instance="fleet-0", tier="gpu") > 0,
        what="index kept",
    )
    assert sample(url, "kvroute_instance_healthy", vllm_instance="fleet-2") is None  # its series went with it
    # and the streams it served to their end after the reload did not bring any of them back
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        assert 'vllm_instance="fleet-2"' not in response.read().decode()
    path.write_text(yaml.safe_dump(config_of(fleet)))  # added back: exported again
    assert call("POST", url + "/admin/reload", headers=AUTH)[0] == 200
    # A candidate again once its first health check passes (the checker's next tick).
    eventually(
        lambda: sample(url, "kvroute_instance_healthy", vllm_instance="fleet-2") == 1, what="fleet-2 checked"
    )
    served = {chat(url, f"b{i}", {"x-kvroute-policy": "round-robin"})["x-kvroute-instance"] for i in range(6)}
    assert "fleet-2" in served
    assert (
        metric(url, "kvroute_requests_total", policy="round-robin", vllm_instance="fleet-2", status="200")
        >= 1
    )
    assert sample(url, "kvroute_instance_healthy", vllm_instance="fleet-0") == 1


def test_a_runtime_split_stays_until_the_files_split_changes(
    admin_router: tuple[str, Path], fleet: FleetPorts
) -> None:
    url, path = admin_router
    assert call("PUT", url + "/admin/traffic", {"split": {"kvroute": 1}}, AUTH)[0] == 200
    config = config_of(fleet)
    config["policies"] = {
        **parse_config(config).model_dump(mode="json")["policies"],
        "spare": {"scorers": [{"type": "round-robin"}]},
    }  # an edit that leaves the split, in its order too (sorted keys would reorder it)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    status, body = call("POST", url + "/admin/reload", headers=AUTH)
    assert status == 200 and body["split"] == {"kvroute": 1.0}
    config["traffic"] = {"split": {"round-robin": 1}}
    path.write_text(yaml.safe_dump(config))
    status, body = call("POST", url + "/admin/reload", headers=AUTH)
    assert status == 200 and body["split"] == {"round-robin": 1.0}


def test_a_reload_keeps_the_state_of_policies_it_does_not_change(fleet: FleetPorts) -> None:
    raw = config_of(fleet)
    old = parse_config(raw)
    table = RoutingTable.from_config(old)
    before = dict(table.policies)
    for name in before:
        table.ab.first_byte(name, 0.1)
    raw["policies"] = {name: spec.model_dump(mode="json") for name, spec in old.policies.items()}
    raw["policies"]["round-robin"] = {"scorers": [{"type": "inflight-load"}]}
    table, started_afresh = table.reloaded(old, parse_config(raw))
    assert started_afresh == ["round-robin"]
    assert table.policies["round-robin"] is not before["round-robin"]
    assert all(table.policies[name] is before[name] for name in before if name != "round-robin")
    report = table.ab.report({"kvroute": 1, "round-robin": 1, "least-loaded": 1})
    samples = {comparison["candidate"]: comparison["samples"] for comparison in report["comparisons"]}
    assert samples["round-robin"] == [1, 0]  # the redefined one starts afresh
    assert samples["least-loaded"] == [1, 1]


def test_a_policy_removed_and_added_back_starts_afresh() -> None:
    full = parse_config(RAW)
    table = RoutingTable.from_config(full)
    old = table.policies["round-robin"]
    table.ab.failed("round-robin")
    without = {
        name: spec.model_dump(mode="json") for name, spec in full.policies.items() if name != "round-robin"
    }
    smaller = parse_config({**RAW, "policies": without})
    table, _ = table.reloaded(full, smaller)
    table, _ = table.reloaded(smaller, full)
    # A request the old one routed ends now: its result goes nowhere.
    table.ab_for(old).failed("round-robin")
    assert table.ab.report({"round-robin": 1})["policies"]["round-robin"]["requests"] == 0
    table.ab_for(table.policies["round-robin"]).failed("round-robin")
    assert table.ab.report({"round-robin": 1})["policies"]["round-robin"]["requests"] == 1


def test_a_file_split_only_reordered_replaces_the_running_one() -> None:
    """The first policy is the A/B baseline, and the ranges are laid out in order: order is part of a split."""
    old = parse_config({**RAW, "traffic": {"split": {"round-robin": 1, "kvroute": 1}}})
    new = parse_config({**RAW, "traffic": {"split": {"kvroute": 1, "round-robin": 1}}})
    table, _ = RoutingTable.from_config(old).reloaded(old, new)
    assert list(table.split.weights) == ["kvroute", "round-robin"]


def test_the_watch_outlives_a_reload_that_fails_unexpectedly(tmp_path: Path) -> None:
    """Dead, the watch would also take SIGHUP's handler with it: the next SIGHUP would end the router."""
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(RAW))
    config = parse_config(RAW)
    attempts: list[int] = []

    async def failing(trigger: str = "") -> dict[str, Any]:
        attempts.append(1)
        raise RuntimeError("a bug in a reload")

    async def watch() -> None:
        reloader = Reloader(Runtime(config), path)
        reloader.reload = failing  # type: ignore[method-assign]
        task = asyncio.create_task(reloader.watch())
        deadline = time.monotonic() + 15
        while len(attempts) < 2:  # the watch may start after the first edits
            assert time.monotonic() < deadline, "no reload on editing the file"
            path.write_text(yaml.safe_dump(RAW) + f"# edit {time.monotonic()}\n")
            await asyncio.sleep(0.3)
            if task.done():
                task.result()  # its exception fails the test
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(watch())


def test_a_token_from_the_environment_loses_a_files_trailing_newline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVROUTE_TEST_ADMIN_TOKEN", TOKEN + "\n")
    assert admin_token(AdminConfig(token_env="KVROUTE_TEST_ADMIN_TOKEN")) == TOKEN


def test_a_short_token_from_the_environment_leaves_the_admin_routes_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVROUTE_TEST_ADMIN_TOKEN", "abc")
    assert admin_token(AdminConfig(token_env="KVROUTE_TEST_ADMIN_TOKEN")) is None
    monkeypatch.setenv("KVROUTE_TEST_ADMIN_TOKEN", "x" * 16)
    assert admin_token(AdminConfig(token_env="KVROUTE_TEST_ADMIN_TOKEN")) == "x" * 16
