"""anthropic_error_body against real vLLM 0.32: the chat endpoint's OpenAI-shaped answer to a fault, turned into
the Anthropic shape, is byte for byte what /v1/messages and count_tokens answered to the same fault
(tests/fixtures/vllm/messages_render_capture.json, from scripts/capture_messages_renders.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.anthropic_errors import anthropic_error, anthropic_error_body

ERRORS = json.loads(
    (Path(__file__).parents[1] / "fixtures" / "vllm" / "messages_render_capture.json").read_text()
)["errors"]
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")


def _answers(name: str, path: str) -> list[str]:
    return [error["answer"] for error in ERRORS if error["name"] == name and error["path"] == path]


@pytest.mark.parametrize("name", ["unknown_model", "tools_without_auto_tool_choice"])
@pytest.mark.parametrize("path", ANTHROPIC_PATHS)
def test_the_chat_endpoints_error_becomes_what_the_messages_endpoints_answered(name: str, path: str) -> None:
    (openai,) = _answers(name, "/v1/chat/completions")
    (anthropic,) = _answers(name, path)
    assert json.loads(openai)["error"]["message"] == json.loads(anthropic)["error"]["message"]
    assert anthropic_error_body(openai.encode()) == anthropic.encode()


@pytest.mark.parametrize(
    "error", [e for e in ERRORS if e["path"] in ANTHROPIC_PATHS and e["answer"].startswith('{"type":"error"')]
)
def test_anthropic_error_writes_vllms_bytes(error: dict[str, str]) -> None:
    answer = json.loads(error["answer"])["error"]
    assert anthropic_error(answer["message"], answer["type"]) == error["answer"].encode()


def test_body_errors_keep_openais_shape_in_vllm() -> None:
    """What vLLM's request model refuses never reaches the Anthropic handler: the router passes it on as is."""
    refused = [e for e in ERRORS if e["name"] in ("missing_max_tokens", "missing_messages", "not_json")]
    assert len(refused) == 3
    for error in refused:
        assert error["status"] == 400
        assert set(json.loads(error["answer"])["error"]) == {"message", "type", "param", "code"}


def test_non_ascii_and_control_characters_are_written_as_starlette_writes_them() -> None:
    message = 'model `ñé✓` "quoted"\n\ttab \x01 \u2028'
    assert (
        anthropic_error(message, "NotFoundError")
        == (
            '{"type":"error","error":{"type":"NotFoundError","message":"model `ñé✓` \\"quoted\\"\\n\\ttab \\u0001 \u2028"}}'
        ).encode()
    )


@pytest.mark.parametrize(
    "body",
    [
        b'{"detail":"Not Found"}',
        b'{"error":"Unauthorized"}',
        b'{"error":{"message":"m"}}',
        b'{"error":{"message":5,"type":"t"}}',
        b"[1]",
        b"not json",
        b"\xff\xfe",
        b"",
    ],
)
def test_a_body_in_no_openai_error_shape_is_left_as_it_is(body: bytes) -> None:
    assert anthropic_error_body(body) == body


def test_the_router_s_own_errors_translate() -> None:
    openai = (
        b'{"error":{"message":"No instance.","type":"service_unavailable_error","param":null,"code":"x"}}'
    )
    assert json.loads(anthropic_error_body(openai)) == {
        "type": "error",
        "error": {"type": "service_unavailable_error", "message": "No instance."},
    }
