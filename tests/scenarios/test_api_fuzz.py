"""Fuzzing the router's API: whatever a client sends, the answer is never a server error.

schemathesis covers every operation in the router's OpenAPI schema; the OpenAI endpoints read the raw request
(their bodies are forwarded byte for byte), so their schema has no body and hypothesis writes the bodies.
"""

from __future__ import annotations

import json
from typing import Any

import hypothesis.strategies as st
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from tests.support.http import post

MODEL = "tiny-llama"
FUZZ = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,  # the same examples in every run: CI reproducible
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def test_no_operation_answers_a_server_error(router_url: str) -> None:
    # schemathesis's pytest loader (from_fixture) fails under this pytest; its strategies serve as well.
    schema = schemathesis.openapi.from_url(router_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert any(op.path == "/v1/chat/completions" for op in operations)
    for operation in operations:

        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def call(case: schemathesis.Case) -> None:
            case.call_and_validate(checks=[not_a_server_error], timeout=30)

        call()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)
roles = st.sampled_from(["system", "user", "assistant", "tool", "developer", ""]) | json_values
contents = (
    st.text(max_size=50)
    | json_values
    | st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "image_url", "x"]), "text": st.text(max_size=20) | json_values}
        ),
        max_size=3,
    )
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": roles}, optional={"content": contents, "name": json_values, "tool_calls": json_values}
    ),
    max_size=5,
)
# Generation runs for real: every body caps max_tokens (or is rejected for it), so none runs for long.
not_ints = json_values.filter(lambda value: not isinstance(value, int) or isinstance(value, bool))
# No null: it means "up to the context", 32K tokens, half a minute of the test fleet's decoding: slow, not hung.
max_tokens = st.integers(-5, 8) | st.integers(10**12) | not_ints.filter(lambda value: value is not None)
# Routing reads these; the engine reads the rest. Mostly valid values, so the fuzz reaches past decoding.
common = {
    "model": st.just(MODEL) | json_values,
    "stream": st.booleans() | json_values,
    "user": st.text(max_size=10) | json_values,
    "n": st.integers(-2, 3) | st.integers(10**9) | not_ints,
    "temperature": st.floats(allow_nan=False) | json_values,
    "stop": json_values,
    "seed": st.integers() | json_values,
    "add_special_tokens": st.booleans() | json_values,
}
chat_bodies = st.fixed_dictionaries(
    {"model": common.pop("model"), "messages": messages | json_values, "max_tokens": max_tokens},
    optional={
        **common,
        "add_generation_prompt": st.booleans() | json_values,
        "continue_final_message": st.booleans() | json_values,
        "tools": json_values,
        "chat_template": st.text(max_size=40) | json_values,
        "chat_template_kwargs": json_values,
        "documents": json_values,
        "reasoning_effort": json_values,
    },
)
completion_bodies = st.fixed_dictionaries(
    {
        "model": st.just(MODEL) | json_values,
        "prompt": st.text(max_size=50) | st.lists(st.integers(), max_size=8) | json_values,
        "max_tokens": max_tokens,
    },
    optional=common,
)


def assert_not_a_server_error(path: str, raw: bytes) -> None:
    status, _, body = post(path, raw)
    assert status < 500, (status, raw[:500], body[:500])
    if status >= 400:
        error = json.loads(body)["error"]
        assert {"message", "type", "code"} <= error.keys(), body


@FUZZ
@given(body=chat_bodies)
def test_chat_bodies_never_answer_a_server_error(router_url: str, body: dict[str, Any]) -> None:
    assert_not_a_server_error(router_url + "/v1/chat/completions", json.dumps(body).encode())


@FUZZ
@given(body=completion_bodies)
def test_completion_bodies_never_answer_a_server_error(router_url: str, body: dict[str, Any]) -> None:
    assert_not_a_server_error(router_url + "/v1/completions", json.dumps(body).encode())


@FUZZ
@given(raw=st.binary(max_size=200) | json_values.map(lambda value: json.dumps(value).encode()))
def test_arbitrary_bytes_never_answer_a_server_error(router_url: str, raw: bytes) -> None:
    assert_not_a_server_error(router_url + "/v1/chat/completions", raw)
