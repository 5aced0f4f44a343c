"""A ready endpoint of an EndpointSlice as an instance: which endpoints serve, ports by name or from the
configuration, role from the slice's labels, data parallelism from the configuration."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from router.config import ConfigError, parse_config
from router.discovery.settings import DiscoveryConfig
from router.discovery.slices import EndpointError, instance_of_endpoint
from router.discovery.wire import Endpoint, EndpointSlice
from tests.router.discovery.kube_api import endpoint, endpoint_slice

CONFIG = DiscoveryConfig(
    source="endpointslices",
    service="vllm",
    role_label="llm-d.ai/role",
    data_parallel_size=2,
    ports={"http": 8000, "events": 5557, "replay": 5558},  # type: ignore[arg-type]
)


def _slice(ports: dict[str, int] | None = None, ip: str = "10.0.0.7", **kwargs: Any) -> EndpointSlice:
    raw = endpoint_slice("vllm-x1", "vllm", [endpoint("vllm-abc", ip=ip)], ports or {}, **kwargs)
    return msgspec.convert(raw, EndpointSlice)


@pytest.mark.parametrize(
    ("conditions", "serving"),
    [
        ({}, True),  # unknown: ready, as the API asks consumers to take it
        ({"ready": True, "serving": True}, True),
        ({"ready": False}, False),
        ({"ready": False, "serving": True, "terminating": True}, False),  # draining
        ({"ready": True, "serving": True, "terminating": True}, False),  # publishNotReadyAddresses, going
        ({"ready": True, "serving": False}, False),  # publishNotReadyAddresses, not ready
    ],
)
def test_which_endpoints_serve(conditions: dict[str, bool], serving: bool) -> None:
    raw = endpoint("vllm-abc", ready=None) | {"conditions": conditions}
    assert msgspec.convert(raw, Endpoint).serving() is serving
    assert msgspec.convert(raw | {"addresses": []}, Endpoint).serving() is False


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (
            _slice(),
            {
                "name": "vllm-abc",
                "url": "http://10.0.0.7:8000",
                "events": "tcp://10.0.0.7:5557",
                "replay": "tcp://10.0.0.7:5558",
                "role": "both",
                "data_parallel_size": 2,
            },
        ),
        (
            _slice({"http": 9000, "kv-events": 6000, "kv-replay": 6001}),
            {"url": "http://10.0.0.7:9000", "events": "tcp://10.0.0.7:6000", "replay": "tcp://10.0.0.7:6001"},
        ),
        (_slice({"": 9000}), {"url": "http://10.0.0.7:9000", "events": "tcp://10.0.0.7:5557"}),  # a lone port
        (_slice({"metrics": 9090}), {"url": "http://10.0.0.7:8000"}),
        (_slice(ip="fd00::7", address_type="IPv6"), {"url": "http://[fd00::7]:8000"}),
        (_slice(ip="vllm-0.vllm.llm.svc", address_type="FQDN"), {"url": "http://vllm-0.vllm.llm.svc:8000"}),
        (_slice(labels={"llm-d.ai/role": "decode"}), {"role": "decode"}),
    ],
)
def test_endpoint_as_instance(given: EndpointSlice, expected: dict[str, Any]) -> None:
    instance = instance_of_endpoint((given.endpoints or [])[0], given, CONFIG)
    assert {key: getattr(instance, key) for key in expected} == expected


def test_an_endpoint_without_a_pod_is_named_by_its_hostname_or_address() -> None:
    piece = _slice()
    named = msgspec.structs.replace((piece.endpoints or [])[0], target_ref=None, hostname="vllm-7")
    assert instance_of_endpoint(named, piece, CONFIG).name == "vllm-7"
    bare = msgspec.structs.replace(named, hostname=None)
    assert instance_of_endpoint(bare, piece, CONFIG).name == "vllm-x1-10.0.0.7"


@pytest.mark.parametrize(
    "given",
    [
        _slice(ip="x"),
        _slice(ip="vllm_0.svc", address_type="FQDN"),
        _slice(labels={"llm-d.ai/role": "leader"}),
    ],
)
def test_bad_endpoints_are_left_out(given: EndpointSlice) -> None:
    with pytest.raises(EndpointError):
        instance_of_endpoint((given.endpoints or [])[0], given, CONFIG)


@pytest.mark.parametrize(
    ("discovery", "problem"),
    [
        ({"source": "endpointslices", "service": "vllm"}, None),
        ({"source": "endpointslices", "selector": "app=vllm"}, None),
        (
            {"source": "endpointslices"},
            "discovery.service: source endpointslices takes a service or a selector",
        ),
        ({"source": "endpointslices", "service": "vllm", "selector": "app=vllm"}, "a service or a selector"),
        (
            {"source": "kubernetes", "selector": "app=vllm", "service": "vllm"},
            "service: only source endpointslices",
        ),
        ({"source": "endpointslices", "service": "Not_A_Name"}, "discovery.service"),
        (
            {"source": "endpointslices", "service": "vllm", "data_parallel_size": 0},
            "discovery.data_parallel_size",
        ),
    ],
)
def test_the_source_s_keys_are_checked(discovery: dict[str, Any], problem: str | None) -> None:
    raw = {"models": [{"name": "tiny-llama", "tokenizer": "builtin:tiny-llama"}], "discovery": discovery}
    if problem is None:
        assert parse_config(raw).discovery is not None
        return
    with pytest.raises(ConfigError, match=problem):
        parse_config(raw)
