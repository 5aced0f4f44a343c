"""Prefill/decode disaggregation end to end: kvroute in front of a simulated P/D fleet (2 prefill, 2 decode),
with each connector's protocol, and the failures of either leg."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from kvroute.processes import FleetPorts, free_port_block, running_fleet, running_router
from tests.conftest import metric, sample
from tests.support.fake_upstreams import healthy, serving
from tests.support.http import post

ROLES = ("prefill", "prefill", "decode", "decode")
PREFILL, DECODE = {"fleet-0", "fleet-1"}, {"fleet-2", "fleet-3"}
BOOTSTRAP_PORT = 8998  # the fleet's default: decode legs name it, nothing listens there
# The fleet computes 20,000 prompt tokens a second: a long prompt's prefill leg lasts a fraction of one.
FLEET_ARGS = ["--prefill-tps", "20000", "--decode-tps", "1000", "--roles", ",".join(ROLES)]


def long_text(tag: str, words: int = 400) -> str:
    """About 13.5 tokens of the tiny model's a word, starting as no other test's prompt does."""
    return f"{tag}: " + " ".join(f"w{i} alpha beta" for i in range(words))


def chat(text: str, stream: bool = False, max_tokens: int = 4) -> bytes:
    messages = [{"role": "user", "content": text}]
    return json.dumps(
        {
            "model": "tiny-llama",
            "messages": messages,
            "max_tokens": max_tokens,
            "stream": stream,
            "stream_options": {"include_usage": True} if stream else None,
        }
    ).encode()


def pd_config(fleet: FleetPorts, connector: str, **extra: object) -> dict[str, object]:
    config = fleet.router_config(disaggregation={"connector": connector}, **extra)
    instances = config["instances"]
    assert isinstance(instances, list)
    for number, (instance, role) in enumerate(zip(instances, ROLES, strict=True)):
        instance["role"] = role
        if role == "prefill":
            instance |= {
                "kv_engine_id": instance["name"],
                "kv_bootstrap_url": f"http://127.0.0.1:{BOOTSTRAP_PORT + number}",
            }
    return config


# Active checks effectively off: the requests find an instance that died.
PASSIVE_HEALTH = {"interval_s": 60, "unhealthy_after": 100}


def with_instance(config: dict[str, object], index: int, name: str, port: int) -> list[dict[str, object]]:
    """Put the instance name on port in place index's; the configuration's instances."""
    instances = config["instances"]
    assert isinstance(instances, list)
    instances[index] = {**instances[index], "name": name, "url": f"http://127.0.0.1:{port}"}
    return instances


def prefill_legs(router: str) -> float:
    return sum(
        sample(router, "kvroute_pd_leg_seconds_count", leg="prefill", vllm_instance=name) or 0
        for name in ("fleet-0", "fleet-1")
    )


def by_source(fleet: FleetPorts, index: int) -> dict[str, float]:
    url = f"http://127.0.0.1:{fleet.http + index}"
    sources = ("local_compute", "local_cache_hit", "external_kv_transfer")
    return {s: sample(url, "vllm:prompt_tokens_by_source_total", source=s) or 0.0 for s in sources}


@pytest.fixture(scope="module", params=["nixl", "mooncake"])
def pd_fleet(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[FleetPorts, str]]:
    connector = request.param
    ports = FleetPorts.allocate(len(ROLES))
    with running_fleet(
        ports, tmp_path_factory.mktemp(f"pd-fleet-{connector}"), [*FLEET_ARGS, "--kv-connector", connector]
    ):
        yield ports, connector


@pytest.fixture(scope="module")
def pd_router(pd_fleet: tuple[FleetPorts, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    fleet, connector = pd_fleet
    with running_router(pd_config(fleet, connector), tmp_path_factory.mktemp("pd-router")) as url:
        yield url


def test_a_long_prompt_is_prefilled_on_a_prefill_instance_and_its_kv_fetched_by_the_decode_one(
    pd_fleet: tuple[FleetPorts, str], pd_router: str
) -> None:
    fleet, _ = pd_fleet
    before = [by_source(fleet, i) for i in range(len(ROLES))]
    status, headers, payload = post(pd_router + "/v1/chat/completions", chat(long_text("first")))
    assert status == 200, payload
    prefill, decode = headers["x-kvroute-prefill-instance"], headers["x-kvroute-instance"]
    assert prefill in PREFILL and decode in DECODE
    answer = json.loads(payload)
    prompt = answer["usage"]["prompt_tokens"]
    assert prompt > 2000 and answer["usage"]["completion_tokens"] == 4  # the prompt counted once
    assert answer["kv_transfer_params"] is None  # as an aggregated answer
    after = [by_source(fleet, i) for i in range(len(ROLES))]
    p, d = int(prefill[-1]), int(decode[-1])
    assert after[p]["local_compute"] - before[p]["local_compute"] == prompt  # computed there, cold
    # The decode instance fetched the whole prompt and computed none of it.
    assert after[d]["external_kv_transfer"] - before[d]["external_kv_transfer"] == prompt
    assert after[d]["local_compute"] == before[d]["local_compute"]
    assert metric(pd_router, "kvroute_pd_requests_total", model="tiny-llama", path="disaggregated") >= 1
    assert metric(pd_router, "kvroute_pd_leg_seconds_count", leg="prefill", vllm_instance=prefill) >= 1
    assert metric(pd_router, "kvroute_pd_leg_seconds_count", leg="decode", vllm_instance=decode) >= 1


def test_a_stream_goes_both_legs_and_streams_from_the_decode_instance(pd_router: str) -> None:
    status, headers, payload = post(
        pd_router + "/v1/chat/completions", chat(long_text("streamed"), stream=True)
    )
    assert status == 200, payload
    assert headers["x-kvroute-prefill-instance"] in PREFILL and headers["x-kvroute-instance"] in DECODE
    events = [line[6:] for line in payload.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage = [json.loads(e)["usage"] for e in events[:-1] if json.loads(e).get("usage")]
    assert usage and usage[0]["completion_tokens"] == 4 and usage[0]["prompt_tokens"] > 2000


def test_the_next_turn_skips_the_prefill_leg_where_the_decode_instance_holds_the_prefix(
    pd_fleet: tuple[FleetPorts, str], pd_router: str
) -> None:
    fleet, _ = pd_fleet
    text = long_text("conversation")
    session = {"x-session-id": "pd-conversation"}
    status, headers, payload = post(pd_router + "/v1/chat/completions", chat(text), session)
    assert status == 200 and "x-kvroute-prefill-instance" in headers
    decode = headers["x-kvroute-instance"]
    time.sleep(0.3)  # the decode instance's KV events reach the index
    reply = json.loads(payload)["choices"][0]["message"]["content"]
    messages = [
        {"role": "user", "content": text},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "and then?"},
    ]
    body = json.dumps({"model": "tiny-llama", "messages": messages, "max_tokens": 4}).encode()
    before = by_source(fleet, int(decode[-1]))
    status, headers, payload = post(pd_router + "/v1/chat/completions", body, session)
    assert status == 200, payload
    assert headers["x-kvroute-instance"] == decode
    assert "x-kvroute-prefill-instance" not in headers
    after = by_source(fleet, int(decode[-1]))
    assert after["external_kv_transfer"] == before["external_kv_transfer"]
    assert 0 < after["local_compute"] - before["local_compute"] <= 256
    assert metric(pd_router, "kvroute_pd_requests_total", model="tiny-llama", path="skipped") >= 1


def test_a_short_prompt_is_served_whole_by_a_decode_instance(pd_router: str) -> None:
    status, headers, payload = post(pd_router + "/v1/chat/completions", chat("hello there"))
    assert status == 200, payload
    assert headers["x-kvroute-instance"] in DECODE and "x-kvroute-prefill-instance" not in headers


def test_the_agents_apis_go_whole_to_a_decode_instance(pd_router: str) -> None:
    """The prefill leg is a chat or a completion: a Responses or Messages request is not split, however long,
    and goes whole to a decode instance (counted as unsplit)."""
    text = long_text("agent")
    bodies = {
        "/v1/responses": {"model": "tiny-llama", "input": text, "max_output_tokens": 4},
        "/v1/messages": {
            "model": "tiny-llama",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": text}],
        },
    }
    for path, body in bodies.items():
        status, headers, payload = post(pd_router + path, json.dumps(body).encode())
        assert status == 200, payload
        assert headers["x-kvroute-instance"] in DECODE and "x-kvroute-prefill-instance" not in headers
    assert metric(pd_router, "kvroute_pd_requests_total", model="tiny-llama", path="unsplit") >= 2


async def drop(request: web.Request) -> web.StreamResponse:
    """An engine that dies with the request it was sent."""
    await request.read()
    assert request.transport is not None
    request.transport.close()
    return web.Response()


def test_prefill_leg_dropped_is_retried_on_another_prefill_instance(
    pd_fleet: tuple[FleetPorts, str], tmp_path: Path
) -> None:
    fleet, connector = pd_fleet
    config = pd_config(fleet, connector, health=PASSIVE_HEALTH)
    with serving(healthy, drop, path="/v1/chat/completions") as port:
        with_instance(config, 0, "dying-prefill", port)
        with running_router(config, tmp_path) as url:
            prefilled = set()
            for n in range(3):  # round robin over the prefill instances reaches the dying one
                status, headers, payload = post(
                    url + "/v1/chat/completions",
                    chat(long_text(f"retry {n}")),
                    {"x-kvroute-policy": "round-robin"},
                )
                assert status == 200, payload
                assert headers["x-kvroute-instance"] in DECODE
                prefilled.add(headers["x-kvroute-prefill-instance"])
            assert prefilled == {"fleet-1"}
            assert (
                metric(
                    url, "kvroute_upstream_errors_total", vllm_instance="dying-prefill", kind="disconnected"
                )
                >= 1
            )


def test_with_no_prefill_instance_up_the_decode_instance_computes_the_prompt(
    pd_fleet: tuple[FleetPorts, str], tmp_path: Path
) -> None:
    fleet, connector = pd_fleet
    config = pd_config(fleet, connector, health=PASSIVE_HEALTH)
    dead = free_port_block(2)
    for n in (0, 1):
        with_instance(config, n, f"dead-{n}", dead + n)
    with running_router(config, tmp_path) as url:
        status, headers, payload = post(url + "/v1/chat/completions", chat(long_text("fallback")))
        assert status == 200, payload
        assert headers["x-kvroute-instance"] in DECODE and "x-kvroute-prefill-instance" not in headers
        assert metric(url, "kvroute_pd_requests_total", model="tiny-llama", path="fallback") == 1


def test_decode_leg_that_cannot_connect_goes_to_another_decode_instance_with_the_same_kv(
    pd_fleet: tuple[FleetPorts, str], tmp_path: Path
) -> None:
    fleet, connector = pd_fleet
    config = pd_config(fleet, connector, health=PASSIVE_HEALTH)
    with contextlib.ExitStack() as stack:
        with serving(healthy, drop, path="/v1/chat/completions") as port:
            with_instance(config, 2, "dead-decode", port)
            url = stack.enter_context(running_router(config, tmp_path))
        # Gone after the router found it healthy: its next connection is refused.
        for n in range(2):  # round robin reaches the dead decode instance
            before = by_source(fleet, 3)
            status, headers, payload = post(
                url + "/v1/chat/completions",
                chat(long_text(f"decode retry {n}")),
                {"x-kvroute-policy": "round-robin"},
            )
            assert status == 200, payload
            assert headers["x-kvroute-instance"] == "fleet-3"
            prompt = json.loads(payload)["usage"]["prompt_tokens"]
            after = by_source(fleet, 3)
            assert after["external_kv_transfer"] - before["external_kv_transfer"] == prompt
        assert metric(url, "kvroute_upstream_errors_total", vllm_instance="dead-decode", kind="connect") >= 1
        # One prefill leg a request: the KV computed for the unreachable instance was fetched by the other.
        assert prefill_legs(url) == 2


def test_decode_leg_dropped_before_its_first_byte_gets_a_fresh_prefill_elsewhere(
    pd_fleet: tuple[FleetPorts, str], tmp_path: Path
) -> None:
    fleet, connector = pd_fleet
    config = pd_config(fleet, connector, health=PASSIVE_HEALTH)
    with serving(healthy, drop, path="/v1/chat/completions") as port:
        with_instance(config, 2, "dying-decode", port)
        with running_router(config, tmp_path) as url:
            statuses, decoded = [], set()
            for n in range(2):
                status, headers, _payload = post(
                    url + "/v1/chat/completions",
                    chat(long_text(f"dropped {n}")),
                    {"x-kvroute-policy": "round-robin"},
                )
                statuses.append(status)
                decoded.add(headers.get("x-kvroute-instance"))
            assert statuses == [200, 200] and decoded == {"fleet-3"}
            assert (
                metric(
                    url, "kvroute_upstream_errors_total", vllm_instance="dying-decode", kind="disconnected"
                )
                >= 1
            )
            assert (
                prefill_legs(url) == 3
            )  # the dropped request's KV may have gone with the decode leg: prefilled anew


def test_a_client_that_leaves_during_the_prefill_leg_aborts_it(
    pd_fleet: tuple[FleetPorts, str], tmp_path: Path
) -> None:
    fleet, connector = pd_fleet
    with running_router(pd_config(fleet, connector), tmp_path) as url:
        prefill_urls = [f"http://127.0.0.1:{fleet.http + i}" for i in (0, 1)]

        def aborted() -> float:
            return sum(
                sample(u, "vllm:request_success_total", finished_reason="abort") or 0 for u in prefill_urls
            )

        before = aborted()

        async def leave() -> None:
            async with aiohttp.ClientSession() as session:
                # ~27,000 tokens: over a second of prefill at the fleet's rate.
                body = chat(long_text("left", words=2000))
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.4):
                        await session.post(
                            url + "/v1/chat/completions",
                            data=body,
                            headers={"content-type": "application/json"},
                        )

        asyncio.run(leave())
        deadline = time.monotonic() + 10
        while aborted() == before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert aborted() == before + 1
        # Nothing stays counted in flight on any instance.
        while time.monotonic() < deadline and any(
            sample(url, "kvroute_instance_in_flight", vllm_instance=f"fleet-{i}") for i in range(4)
        ):
            time.sleep(0.1)
        assert not any(
            sample(url, "kvroute_instance_in_flight", vllm_instance=f"fleet-{i}") for i in range(4)
        )


def test_a_prefill_leg_past_the_first_byte_timeout_is_a_504_and_holds_nothing(
    pd_fleet: tuple[FleetPorts, str], tmp_path: Path
) -> None:
    fleet, connector = pd_fleet

    async def stall(request: web.Request) -> web.StreamResponse:
        await request.read()
        await asyncio.sleep(30)
        return web.Response()

    config = pd_config(fleet, connector, upstream={"first_byte_timeout_s": 0.5})
    with serving(healthy, stall, path="/v1/chat/completions") as port:
        del with_instance(config, 0, "stalled-prefill", port)[
            1
        ]  # the stalled one is the only prefill instance
        with running_router(config, tmp_path) as url:
            started = time.monotonic()
            status, _, payload = post(url + "/v1/chat/completions", chat(long_text("stalled")))
            assert time.monotonic() - started < 10
            assert status == 504 and json.loads(payload)["error"]["code"] == "upstream_timeout"
            names = ("stalled-prefill", "fleet-2", "fleet-3")
            assert not any(sample(url, "kvroute_instance_in_flight", vllm_instance=name) for name in names)
