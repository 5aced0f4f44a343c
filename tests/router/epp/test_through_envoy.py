"""OpenAI clients through Envoy -> `kvroute epp` -> the simulated fleet: the picker decides, Envoy relays."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from anthropic import Anthropic
from grpc_health.v1 import health_pb2, health_pb2_grpc
from openai import APITimeoutError, NotFoundError, OpenAI

from kvroute.processes import FleetPorts
from tests.conftest import metric, sample
from tests.router.epp.conftest import (
    Gateway,
    Picker,
    envoy_config,
    fleet_endpoints,
    picker_config,
    running_envoy,
    running_picker,
)

MODEL = "tiny-llama"
INSTANCE = "x-kvroute-instance"


def client(gateway: Gateway) -> OpenAI:
    return OpenAI(base_url=gateway.url, api_key="unused", max_retries=0, timeout=30)


def in_flight(picker: Picker) -> float:
    """Requests the picker counts in flight, over every instance."""
    return sum(
        sample(picker.metrics_url, "kvroute_instance_in_flight", vllm_instance=f"fleet-{i}") or 0
        for i in range(3)
    )


def wait_none_in_flight(picker: Picker, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while in_flight(picker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert in_flight(picker) == 0


@pytest.mark.parametrize("stream", [False, True])
def test_chat(gateway: Gateway, picker: Picker, stream: bool) -> None:
    raw = client(gateway).chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"Say hello, stream={stream}."}],
        max_tokens=8,
        stream=stream,
    )
    assert raw.headers[INSTANCE].startswith("fleet-")
    assert "x-gateway-destination-endpoint-served" not in raw.headers  # the picker's, not the client's
    answer = raw.parse()
    if stream:
        text = "".join(chunk.choices[0].delta.content or "" for chunk in answer if chunk.choices)
    else:
        text = answer.choices[0].message.content or ""
    assert text
    wait_none_in_flight(picker)


@pytest.mark.parametrize("stream", [False, True])
def test_completions(gateway: Gateway, picker: Picker, stream: bool) -> None:
    raw = client(gateway).completions.with_raw_response.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, stream=stream
    )
    assert raw.headers[INSTANCE].startswith("fleet-")
    answer = raw.parse()
    text = "".join(c.choices[0].text for c in answer if c.choices) if stream else answer.choices[0].text
    assert text
    wait_none_in_flight(picker)


def test_a_session_sticks_to_its_prefix_instance(gateway: Gateway, picker: Picker) -> None:
    messages = [{"role": "system", "content": "You are a patient assistant. " * 40}]
    served = []
    for turn in range(4):
        messages.append({"role": "user", "content": f"Question number {turn}: tell me more."})
        raw = client(gateway).chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=8, extra_headers={"x-session-id": "epp-session-1"}
        )
        served.append(raw.headers[INSTANCE])
        messages.append({"role": "assistant", "content": raw.parse().choices[0].message.content or ""})
    assert len(set(served)) == 1, served
    # The picker learnt from the answers Envoy relayed: the requests counted as answered there, and the
    # later turns found their prefix cached (the fleet's KV events reached the picker's index). A request
    # ends when Envoy closes its stream, just after the client has the answer.
    wait_none_in_flight(picker)
    assert metric(picker.metrics_url, "kvroute_requests_total", vllm_instance=served[0], status="200") >= 4
    assert metric(picker.metrics_url, "kvroute_session_turns_total", placement="same") >= 3


def test_a_stream_teaches_the_ttft_model(gateway: Gateway, picker: Picker) -> None:
    before = sum(
        sample(picker.metrics_url, "kvroute_ttft_observed_seconds_count", vllm_instance=f"fleet-{i}") or 0
        for i in range(3)
    )
    stream = client(gateway).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to three."}], max_tokens=4, stream=True
    )
    assert list(stream)
    after = sum(
        sample(picker.metrics_url, "kvroute_ttft_observed_seconds_count", vllm_instance=f"fleet-{i}") or 0
        for i in range(3)
    )
    assert after == before + 1


def test_a_client_gone_mid_stream_leaves_nothing_in_flight(gateway: Gateway, picker: Picker) -> None:
    stream = client(gateway).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Write a long story."}],
        max_tokens=3000,
        stream=True,
    )
    next(iter(stream))
    assert in_flight(picker) == 1
    stream.close()
    wait_none_in_flight(picker)


def test_a_client_gone_before_its_answer_began_leaves_nothing_in_flight(
    gateway: Gateway, picker: Picker
) -> None:
    """No answer's headers, so no answering stream: the observing stream's end tells the picker (Envoy closes
    it a second after the request, its deferred_close_timeout)."""
    impatient = OpenAI(base_url=gateway.url, api_key="unused", max_retries=0, timeout=1.0)
    with ThreadPoolExecutor(1) as pool:
        whole = pool.submit(
            impatient.chat.completions.create,
            model=MODEL,
            messages=[{"role": "user", "content": "Write a long story, all at once."}],
            max_tokens=3000,  # 3 s at the fleet's pace: the client leaves after 1 s, before the answer
        )
        deadline = time.monotonic() + 10
        while not in_flight(picker):
            assert time.monotonic() < deadline, "never counted in flight"
            time.sleep(0.05)
        with pytest.raises(APITimeoutError):
            whole.result(timeout=30)
    wait_none_in_flight(picker, timeout_s=20)


def post(gateway: Gateway, path: str, body: bytes) -> tuple[int, dict[str, object]]:
    request = urllib.request.Request(gateway.url + path, body, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        (b"", 400, "invalid_json"),
        (b'{"model": "\x80", "messages": []}', 400, "invalid_encoding"),  # as `kvroute serve` answers it
        (b'{"model": "tiny-llama", "messages": []}', 400, "invalid_field"),
        (
            b'{"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}',
            404,
            "model_not_found",
        ),
    ],
)
def test_a_bad_body_gets_the_routers_4xx(gateway: Gateway, body: bytes, status: int, code: str) -> None:
    got, answer = post(gateway, "/chat/completions", body)
    assert got == status
    error = answer["error"]
    assert isinstance(error, dict) and error["code"] == code


@pytest.mark.parametrize(
    ("service", "status"),
    [
        ("", health_pb2.HealthCheckResponse.SERVING),
        ("liveness", health_pb2.HealthCheckResponse.SERVING),
        ("readiness", health_pb2.HealthCheckResponse.SERVING),
        ("envoy.service.ext_proc.v3.ExternalProcessor", health_pb2.HealthCheckResponse.SERVING),
    ],
)
def test_the_health_service_answers(picker: Picker, service: str, status: int) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{picker.port}") as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    assert answer.status == status


def test_the_health_service_knows_no_other_service(picker: Picker) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{picker.port}") as channel, pytest.raises(grpc.RpcError) as raised:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_responses_chain_stays_where_its_responses_are_stored(gateway: Gateway, picker: Picker) -> None:
    """Each turn names the previous response: the picker sends it to the instance holding that response,
    and (whole answers: the picker reads their output) predicts what the engine finds cached."""
    openai = client(gateway)
    previous, instances = None, set()
    for turn in range(4):
        raw = openai.responses.with_raw_response.create(
            model=MODEL,
            instructions="You review patches.",
            input=f"Turn {turn}: review the next hunk of the parser. " * 8,
            max_output_tokens=4,
            **({"previous_response_id": previous} if previous else {}),
        )
        response = raw.parse()
        instances.add(raw.headers[INSTANCE])
        previous = response.id
        assert response.usage is not None
        predicted = int(raw.headers["x-kvroute-cached-blocks"]) * 32  # the fleet's block size
        assert predicted == response.usage.input_tokens_details.cached_tokens
    assert len(instances) == 1
    retrieved = openai.responses.with_raw_response.retrieve(previous)
    assert retrieved.headers[INSTANCE] in instances and retrieved.parse().id == previous
    with pytest.raises(NotFoundError):
        openai.responses.create(
            model=MODEL, input="x", previous_response_id="resp_unknown", max_output_tokens=2
        )
    wait_none_in_flight(picker)


def test_responses_and_messages_stream_through_the_gateway(gateway: Gateway, picker: Picker) -> None:
    events = list(
        client(gateway).responses.create(
            model=MODEL, input="Stream a review.", max_output_tokens=4, stream=True
        )
    )
    assert events[-1].type == "response.completed"
    messages = Anthropic(base_url=gateway.url.removesuffix("/v1"), api_key="unused", max_retries=0)
    with messages.messages.stream(
        model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Stream a reply."}]
    ) as stream:
        final = stream.get_final_message()
    assert final.usage.output_tokens == 4
    counted = messages.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "count me"}])
    assert counted.input_tokens > 0
    wait_none_in_flight(picker)


def test_a_stored_response_is_its_creating_keys_alone_through_the_gateway(
    epp_fleet: FleetPorts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With client keys in the picker's configuration, another key's retrieval, cancellation and follow-up
    of a stored response are answered 404, as an unknown id is, by the picker itself."""
    monkeypatch.setenv("KVROUTE_TEST_TENANT_KEYS", "alice-key-0123,bob-key-0123")
    config = picker_config([epp_fleet], auth={"api_keys_env": "KVROUTE_TEST_TENANT_KEYS"})
    with running_picker(config, tmp_path / "epp") as keyed:
        envoy, listen, admin = envoy_config(fleet_endpoints([epp_fleet]), keyed.port)
        with running_envoy(envoy, listen, admin, tmp_path / "envoy") as gateway:
            alice, bob = (
                OpenAI(base_url=gateway.url, api_key=key, max_retries=0, timeout=30)
                for key in ("alice-key-0123", "bob-key-0123")
            )
            created = alice.responses.create(model=MODEL, input="hello", max_output_tokens=2, store=True)
            for asked in (
                lambda: bob.responses.retrieve(created.id),
                lambda: bob.responses.cancel(created.id),
                lambda: bob.responses.create(
                    model=MODEL, input="and?", previous_response_id=created.id, max_output_tokens=2
                ),
            ):
                with pytest.raises(NotFoundError, match=f"Response with id '{created.id}' not found"):
                    asked()
            assert alice.responses.retrieve(created.id).id == created.id
