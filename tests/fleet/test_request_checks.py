"""The simulated fleet checks request bodies as vLLM 0.32 does (vllm/entrypoints: serving.py's
_is_model_supported, generate/base/protocol.py's validate_cache_salt, Python's json for the body)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from fleet.server import max_tokens_for
from kvroute.processes import FleetPorts
from tests.conftest import instance_url


def _post(ports: FleetPorts, raw: bytes) -> tuple[int, Any]:
    request = urllib.request.Request(
        instance_url(ports, 0) + "/v1/completions",
        data=raw,
        method="POST",
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def test_a_body_naming_no_model_is_for_the_instances_own(fleet: FleetPorts) -> None:
    status, body = _post(fleet, b'{"prompt": "hello", "max_tokens": 2}')
    assert (status, body["model"]) == (200, "tiny-llama")


def test_a_body_after_a_byte_order_mark_is_read(fleet: FleetPorts) -> None:
    status, _ = _post(fleet, b'\xef\xbb\xbf{"model": "tiny-llama", "prompt": "hello", "max_tokens": 2}')
    assert status == 200


@pytest.mark.parametrize(
    ("salt", "message"),
    [
        ("", "Parameter 'cache_salt' must be a non-empty string if provided."),
        (7, "Parameter 'cache_salt' must be a non-empty string if provided."),
        (
            "tenant/a",
            "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', "
            "'\\\\', or NUL.",
        ),
        (
            "x" * 129,
            "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', "
            "'\\\\', or NUL.",
        ),
    ],
)
def test_cache_salts_vllm_refuses_are_refused(fleet: FleetPorts, salt: object, message: str) -> None:
    raw = json.dumps({"model": "tiny-llama", "prompt": "hello", "max_tokens": 2, "cache_salt": salt}).encode()
    status, body = _post(fleet, raw)
    assert (status, body["error"]["message"], body["error"]["param"]) == (400, message, "cache_salt")
    assert _post(fleet, raw.replace(json.dumps(salt).encode(), b'"tenant-a"'))[0] == 200


def test_booleans_are_read_as_vllms_models_read_them(fleet: FleetPorts) -> None:
    """ "false" is False to pydantic, and to the router; read as a truthy string it would stream."""
    raw = b'{"model": "tiny-llama", "prompt": "hello", "max_tokens": 2, "stream": "false"}'
    status, body = _post(fleet, raw)
    assert (status, body["object"]) == (200, "text_completion")
    status, body = _post(fleet, raw.replace(b'"false"', b'"maybe"'))
    assert (status, body["error"]["param"]) == (400, "stream")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", "hot", "temperature: Input should be a valid number"),
        ("temperature", [1], "temperature: Input should be a valid number"),
        ("temperature", -0.5, "temperature must be non-negative, got -0.5."),
        ("temperature", 3, "temperature must be in [0, 2], got 3.0."),
        ("temperature", "nan", "temperature must be a finite number, got nan."),
        ("top_p", 0, "top_p must be in (0, 1], got 0.0."),
        ("min_p", 1.5, "min_p must be in [0, 1], got 1.5."),
        ("presence_penalty", "-3", "presence_penalty must be in [-2, 2], got -3.0."),
        ("repetition_penalty", 0, "repetition_penalty must be greater than zero, got 0.0."),
    ],
)
def test_sampling_parameters_vllm_refuses_are_refused(
    fleet: FleetPorts, field: str, value: object, message: str
) -> None:
    """vLLM 0.32 reads them as pydantic's lax floats, then SamplingParams checks their ranges."""
    raw = json.dumps({"model": "tiny-llama", "prompt": "hello", "max_tokens": 2, field: value}).encode()
    status, body = _post(fleet, raw)
    assert (status, body["error"]["message"], body["error"]["param"]) == (400, message, field)


@pytest.mark.parametrize("value", ["0.5", 1, True, None])
def test_sampling_parameters_vllm_reads_as_numbers_are_taken(fleet: FleetPorts, value: object) -> None:
    raw = json.dumps(
        {"model": "tiny-llama", "prompt": "hello", "max_tokens": 2, "temperature": value}
    ).encode()
    assert _post(fleet, raw)[0] == 200


def test_a_request_naming_no_budget_gets_the_max_new_tokens_default() -> None:
    """vLLM's --override-generation-config '{"max_new_tokens": N}': N for a request without max_tokens, the
    rest of the context without N, and what the request names when it names one."""
    assert max_tokens_for(100, {}, 40, chat=True, from_text=True) == 60
    assert max_tokens_for(100, {}, 40, chat=True, from_text=True, default=16) == 16
    assert max_tokens_for(100, {}, 90, chat=True, from_text=True, default=16) == 10
    assert max_tokens_for(100, {"max_tokens": 30}, 40, chat=True, from_text=True, default=16) == 30
