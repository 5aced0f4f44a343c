"""The router's errors on Anthropic's routes, against what real vLLM 0.32 answers there
(tests/fixtures/vllm/messages_render_capture.json, from scripts/capture_messages_renders.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.errors import anthropic_error_json

ERRORS = json.loads(
    (Path(__file__).parents[1] / "fixtures" / "vllm" / "messages_render_capture.json").read_text()
)["errors"]
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")


@pytest.mark.parametrize(
    "error", [e for e in ERRORS if e["path"] in ANTHROPIC_PATHS and e["answer"].startswith('{"type":"error"')]
)
def test_the_router_writes_anthropic_errors_as_vllm_does(error: dict[str, str]) -> None:
    answer = json.loads(error["answer"])["error"]
    assert anthropic_error_json(answer["message"], answer["type"]) == error["answer"].encode()


def test_body_errors_keep_openais_shape_in_vllm() -> None:
    """What vLLM's request model refuses never reaches its Anthropic handler: the router passes it on as is."""
    refused = [e for e in ERRORS if e["name"] in ("missing_max_tokens", "missing_messages", "not_json")]
    assert len(refused) == 3
    for error in refused:
        assert error["status"] == 400
        assert set(json.loads(error["answer"])["error"]) == {"message", "type", "param", "code"}
