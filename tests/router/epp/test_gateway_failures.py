"""What goes wrong behind Envoy: an instance that dies (failover to the next endpoint), a picker that is down
(fail closed or open), a full router (429) and no instance to send to (503)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvroute.bench.overhead.envoy import connection_manager, routing_filter, with_one_filter
from kvroute.processes import FleetPorts, free_port_block, running_fleet
from tests.conftest import metric, sample
from tests.router.epp.conftest import (
    FAST_FLEET,
    envoy_config,
    fleet_endpoints,
    picker_config,
    running_envoy,
    running_picker,
)
from tests.router.epp.test_through_envoy import INSTANCE, MODEL, client, wait_none_in_flight

STICKY = {"sticky": {"scorers": [{"type": "session-affinity"}]}}


def ask(gateway_client: openai.OpenAI, session: str, content: str) -> tuple[str, str]:
    """(the instance that answered, how many endpoints Envoy tried)."""
    raw = gateway_client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=4,
        extra_headers={"x-session-id": session},
    )
    assert raw.parse().choices[0].message.content
    return raw.headers[INSTANCE], raw.headers["x-kvroute-attempts"]


def test_envoy_fails_over_to_the_fallback_when_the_chosen_instance_is_dead(tmp_path: Path) -> None:
    ports = [FleetPorts.allocate(1), FleetPorts.allocate(1)]
    with contextlib.ExitStack() as stack:
        fleets = [
            stack.enter_context(running_fleet(p, tmp_path / f"fleet{n}", FAST_FLEET))
            for n, p in enumerate(ports)
        ]
        # Health checks far apart: the picker learns of the death from Envoy's retry, not from a check.
        config = picker_config(ports, policies=STICKY, default_policy="sticky", health={"interval_s": 60})
        picker = stack.enter_context(running_picker(config, tmp_path))
        envoy, listen, admin = envoy_config(fleet_endpoints(ports), picker.port)
        gateway = client(stack.enter_context(running_envoy(envoy, listen, admin, tmp_path)))

        first, attempts = ask(gateway, "doomed", "Hello there.")
        assert attempts == "1"
        dead = int(first.removeprefix("fleet-"))
        fleets[dead].stop()  # the fleet process this test started, by its process group

        # The session's instance is still the picker's choice; Envoy finds it dead and takes the fallback.
        served, attempts = ask(gateway, "doomed", "Hello there. And again.")
        assert served != first and attempts == "2"
        assert (
            metric(picker.metrics_url, "kvroute_upstream_errors_total", vllm_instance=first, kind="connect")
            == 1
        )
        # From then on the picker routes around it: nothing is tried there first.
        served, attempts = ask(gateway, "doomed", "Hello there. Once more.")
        assert served != first and attempts == "1"


@pytest.fixture(scope="module")
def fleet_only(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetPorts]:
    ports = FleetPorts.allocate(2)
    with running_fleet(ports, tmp_path_factory.mktemp("fleet"), FAST_FLEET):
        yield ports


@pytest.mark.parametrize(
    ("fail_open", "mode", "retries"),
    [
        (False, "FULL_DUPLEX_STREAMED", None),
        (False, "BUFFERED", 1),
        # Fail open needs the body buffered in Envoy: in full duplex Envoy may have handed it to the stream
        # before the stream fails, and then answers 500 whatever failure_mode_allow says (seen here).
        (True, "BUFFERED", 1),
    ],
)
def test_a_picker_that_is_down_fails_closed_or_open(
    fleet_only: FleetPorts, tmp_path: Path, fail_open: bool, mode: str, retries: int | None
) -> None:
    """After Envoy's retries (as shipped: about 10 s, for a picker that restarts; once, where the test looks
    at the failure mode only)."""
    nobody = free_port_block(1)  # no picker listens there
    envoy, listen, admin = envoy_config(
        fleet_endpoints([fleet_only]),
        nobody,
        fail_open=fail_open,
        request_body_mode=mode,
        picker_retries=retries,
    )
    with running_envoy(envoy, listen, admin, tmp_path) as gateway:
        messages = [{"role": "user", "content": "Anyone there?"}]
        started = time.monotonic()
        if fail_open:  # placed by Envoy's own fallback policy, without kvroute's decision
            answer = client(gateway).chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
            assert answer.choices[0].message.content
        else:
            with pytest.raises(openai.APIStatusError) as refused:
                client(gateway).chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
            assert refused.value.status_code >= 500
        if retries is None:  # 40 waits drawn up to 0.5 s (mostly): 9.4 s on average, 3 s is 7 sigmas off
            assert 3 < time.monotonic() - started < 30


def test_a_full_router_answers_429(fleet_only: FleetPorts, tmp_path: Path) -> None:
    config = picker_config([fleet_only], admission={"max_in_flight": 1, "queue_size": 0})
    with running_picker(config, tmp_path) as picker:
        envoy, listen, admin = envoy_config(fleet_endpoints([fleet_only]), picker.port)
        with running_envoy(envoy, listen, admin, tmp_path) as gateway:
            long = client(gateway).chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "A long story."}],
                max_tokens=3000,
                stream=True,
            )
            with long:
                next(iter(long))  # holds the one slot
                with pytest.raises(openai.RateLimitError) as refused:
                    client(gateway).chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": "Me too."}], max_tokens=4
                    )
            error = refused.value.body
            assert isinstance(error, dict) and error["code"] == "queue_full"
            assert refused.value.response.headers["retry-after"] == "1"
            assert metric(picker.metrics_url, "kvroute_rejected_requests_total", reason="queue_full") == 1


def test_no_healthy_instance_answers_503_and_the_picker_is_not_ready(tmp_path: Path) -> None:
    dead = FleetPorts.allocate(1)  # nothing started on its ports
    config = picker_config([dead], health={"interval_s": 0.2, "unhealthy_after": 1})
    with running_picker(config, tmp_path) as picker:
        with grpc.insecure_channel(f"127.0.0.1:{picker.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            def status(service: str) -> int:
                return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status)

            deadline = time.monotonic() + 15  # the instance's checks fail, then readiness follows
            while status("readiness") != health_pb2.HealthCheckResponse.NOT_SERVING:
                assert time.monotonic() < deadline, "still ready with no instance answering"
                time.sleep(0.1)
            assert status("liveness") == health_pb2.HealthCheckResponse.SERVING
        envoy, listen, admin = envoy_config(fleet_endpoints([dead]), picker.port)
        with running_envoy(envoy, listen, admin, tmp_path) as gateway:
            with pytest.raises(openai.APIStatusError) as refused:
                client(gateway).chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "Hello?"}], max_tokens=4
                )
    assert refused.value.status_code == 503
    assert refused.value.response.headers["retry-after"] == "1"
    error = refused.value.body
    assert isinstance(error, dict) and error["code"] == "no_healthy_instance"


def test_an_original_dst_cluster_follows_a_single_endpoint(fleet_only: FleetPorts, tmp_path: Path) -> None:
    with running_picker(picker_config([fleet_only]), tmp_path, "--fallbacks", "0") as picker:
        envoy, listen, admin = envoy_config(
            fleet_endpoints([fleet_only]), picker.port, cluster="fleet_original_dst"
        )
        with running_envoy(envoy, listen, admin, tmp_path) as gateway:
            served, attempts = ask(client(gateway), "plain", "Hello through ORIGINAL_DST.")
    assert served.startswith("fleet-") and attempts == "1"


def test_a_buffered_body_is_routed_too(fleet_only: FleetPorts, tmp_path: Path) -> None:
    with running_picker(picker_config([fleet_only]), tmp_path) as picker:
        envoy, listen, admin = envoy_config(
            fleet_endpoints([fleet_only]), picker.port, request_body_mode="BUFFERED"
        )
        with running_envoy(envoy, listen, admin, tmp_path) as gateway:
            served, attempts = ask(client(gateway), "buffered", "Hello, buffered.")
            stream = client(gateway).completions.create(
                model=MODEL, prompt="Buffered", max_tokens=4, stream=True
            )
            assert "".join(c.choices[0].text for c in stream if c.choices)
    assert served.startswith("fleet-") and attempts == "1"


def test_the_subset_hint_limits_the_choice(fleet_only: FleetPorts, tmp_path: Path) -> None:
    """A gateway that allows only the second instance (Envoy's set_metadata filter puts the hint where the
    protocol says, and ext_proc forwards that namespace): every request goes there."""
    allowed = f"127.0.0.1:{fleet_only.http + 1}"
    with running_picker(picker_config([fleet_only]), tmp_path) as picker:
        envoy, listen, admin = envoy_config(fleet_endpoints([fleet_only]), picker.port)
        routing_filter(envoy)["metadata_options"]["forwarding_namespaces"] = {
            "untyped": ["envoy.lb.subset_hint"]
        }
        hint = {
            "name": "envoy.filters.http.set_metadata",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
                "metadata": [
                    {
                        "metadata_namespace": "envoy.lb.subset_hint",
                        "value": {"x-gateway-destination-endpoint-subset": [allowed]},
                    }
                ],
            },
        }
        connection_manager(envoy)["http_filters"].insert(0, hint)
        with running_envoy(envoy, listen, admin, tmp_path) as gateway:
            served = {ask(client(gateway), f"subset-{n}", f"Hello number {n}.")[0] for n in range(6)}
    assert served == {"fleet-1"}


def test_a_gateway_with_one_filter_is_followed_on_its_routing_stream(
    fleet_only: FleetPorts, tmp_path: Path
) -> None:
    """The Gateway API Inference Extension's gateways call the picker from one ext_proc filter, which shows
    it the answer too and holds its stream to the request's end: the picker follows the answer there."""
    with running_picker(picker_config([fleet_only]), tmp_path) as picker:
        envoy, listen, admin = envoy_config(fleet_endpoints([fleet_only]), picker.port)
        with running_envoy(with_one_filter(envoy), listen, admin, tmp_path) as gateway:
            served, attempts = ask(client(gateway), "one-filter", "Hello, one filter.")
            stream = client(gateway).completions.create(model=MODEL, prompt="One", max_tokens=4, stream=True)
            assert "".join(c.choices[0].text for c in stream if c.choices)
            wait_none_in_flight(picker)
        assert served.startswith("fleet-") and attempts == "1"
        assert metric(picker.metrics_url, "kvroute_requests_total", vllm_instance=served, status="200") >= 1
        with urllib.request.urlopen(picker.metrics_url + "/metrics?name[]=kvroute_requests_total") as named:
            types = [line for line in named.read().decode().splitlines() if line.startswith("# TYPE")]
        assert types == ["# TYPE kvroute_requests_total counter"]  # Prometheus' name[]: that family alone


def test_the_picker_holds_envoys_request_while_the_instance_prefills(tmp_path: Path) -> None:
    """Flow control in the endpoint picker: while the one instance prefills a long prompt, the next request's
    routing stream is held (Envoy waits for the picker), then routed once its first byte came; one past its
    objective's queue time is refused with a 429 and the drop reason."""
    ports = FleetPorts.allocate(1)
    with contextlib.ExitStack() as stack:
        stack.enter_context(running_fleet(ports, tmp_path / "fleet", ["--prefill-tps", "500"]))
        objectives = {"default": {"max_queue_s": 10}, "impatient": {"max_queue_s": 0.5}}
        flow_control = {"engine_queue_s": 0.0, "objectives": objectives}
        picker = stack.enter_context(
            running_picker(picker_config([ports], flow_control=flow_control), tmp_path)
        )
        envoy, listen, admin = envoy_config(fleet_endpoints([ports]), picker.port)
        gateway = client(stack.enter_context(running_envoy(envoy, listen, admin, tmp_path)))
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            # About 4 s of prefill; streamed, so its first byte tells the picker when the prefill ended.
            long = pool.submit(
                lambda: list(
                    gateway.completions.create(model=MODEL, prompt=[5] * 2000, max_tokens=1, stream=True)
                )
            )
            deadline = time.monotonic() + 20
            while sample(picker.metrics_url, "kvroute_instance_in_flight") != 1:
                assert time.monotonic() < deadline, "the long prompt never went"
                time.sleep(0.05)
            waited = pool.submit(
                gateway.completions.with_raw_response.create, model=MODEL, prompt=[6] * 50, max_tokens=1
            )
            with pytest.raises(openai.RateLimitError) as refused:
                gateway.completions.create(
                    model=MODEL,
                    prompt=[7] * 50,
                    max_tokens=1,
                    extra_headers={"x-gateway-inference-objective": "impatient"},
                )
            assert refused.value.response.headers["x-kvroute-dropped-reason"] == "queue_timeout"
            assert not waited.done()
            long.result(timeout=30)
            raw = waited.result(timeout=30)
        assert raw.parse().choices
        assert float(raw.headers["x-kvroute-queued-ms"]) > 1000
        assert metric(picker.metrics_url, "kvroute_flow_control_dispatched_total", how="queued") == 1
        wait_none_in_flight(picker)
