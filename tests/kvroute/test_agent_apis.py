"""Each API's turn: its request body from the history, and its stream read as vLLM 0.32 sends it (the
captured streams of tests/fixtures/vllm/agent_api_capture.json) or as kvroute ends a stream it cuts."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvroute.agent_apis import (
    READERS,
    Api,
    History,
    StreamReading,
    anthropic_prompt_tokens,
    request_body,
)
from kvroute.agent_sessions import Reply, SessionPlan, TurnOutcome, http_error_detail, stream_turn
from kvroute.workload import AgentWorkload
from router.dispatch.answer.relay import stream_error

CAPTURE = Path(__file__).parents[1] / "fixtures" / "vllm" / "agent_api_capture.json"


def _captured(name: str) -> dict[str, Any]:
    requests = json.loads(CAPTURE.read_text())["requests"]
    return next(r for r in requests if r["name"] == name)


def _events(stream: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: ")]


def _read(api: Api, stream: str) -> StreamReading:
    reading = StreamReading()
    for index, event in enumerate(_events(stream)):
        READERS[api](event, reading, float(index + 1))
    return reading


def test_a_captured_responses_stream() -> None:
    stream = _captured("responses_stream")["answer"]
    events = _events(stream)
    completed = events[-1]
    assert completed["type"] == "response.completed"
    done = next(e for e in events if e["type"] == "response.output_text.done")
    first_delta = next(i for i, e in enumerate(events) if e["type"] == "response.output_text.delta")

    reading = _read("responses", stream)

    assert reading.finished and not reading.error
    assert "".join(reading.text) == done["text"]
    assert reading.ttft == first_delta + 1  # the first text delta, not response.created
    assert reading.prompt_tokens == completed["response"]["usage"]["input_tokens"] > 0
    assert reading.response_id == "resp_cap_s"  # the id the capture asked vLLM to store it under


def test_a_captured_messages_stream() -> None:
    stream = _captured("messages_stream")["answer"]
    events = _events(stream)
    start, delta = events[0], next(e for e in events if e["type"] == "message_delta")

    reading = _read("messages", stream)

    assert reading.finished and not reading.error
    assert "".join(reading.text) == "8XHER*/"
    assert reading.ttft == 3  # message_start, content_block_start, then the first text_delta
    # message_delta splits the prompt by the cache (vLLM ran --enable-prompt-tokens-details); the sum is the
    # whole prompt, as message_start counts it
    assert delta["usage"]["input_tokens"] < start["message"]["usage"]["input_tokens"]
    assert reading.prompt_tokens == anthropic_prompt_tokens(delta["usage"]) == 213
    assert start["message"]["usage"]["input_tokens"] == 213


@pytest.mark.parametrize(
    ("api", "stream", "error"),
    [
        ("responses", stream_error("engine fleet-1 went away", "stream_broken", "responses"), "went away"),
        ("responses", 'data: {"type":"response.failed","response":{"error":{"message":"boom"}}}\n\n', "boom"),
        ("messages", stream_error("engine fleet-1 went away", "stream_broken", "messages"), "went away"),
    ],
)
def test_error_events(api: Api, stream: bytes | str, error: str) -> None:
    text = stream.decode() if isinstance(stream, bytes) else stream
    assert error in _read(api, text).error


def _history(*texts: str) -> History:
    history = History("You are a coding agent.")
    history.texts.extend(texts)
    return history


def test_bodies_send_the_whole_history() -> None:
    history = _history("u0", "a0", "u1")

    chat = request_body("chat", history, "m", 4)
    responses = request_body("responses", history, "m", 4)
    messages = request_body("messages", history, "m", 4)

    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "user"]
    assert chat["stream_options"] == {"include_usage": True} and chat["max_tokens"] == 4
    assert responses["instructions"] == "You are a coding agent." and responses["store"] is False
    assert responses["input"] == [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "u0"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a0"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "u1"}]},
    ]
    assert responses["max_output_tokens"] == 4 and "previous_response_id" not in responses
    assert messages["system"] == "You are a coding agent." and messages["max_tokens"] == 4
    assert messages["messages"] == [
        {"role": "user", "content": "u0"},
        {"role": "assistant", "content": "a0"},
        {"role": "user", "content": "u1"},
    ]
    assert all(body["stream"] and body["temperature"] == 0 for body in (chat, responses, messages))


def test_a_chain_sends_what_the_last_stored_response_does_not_hold() -> None:
    history = _history("u0")
    assert "previous_response_id" not in request_body("responses", history, "m", 4, chain=True)
    history.answered("a0", stored_as="resp_1")
    history.texts.append("u1")

    body = request_body("responses", history, "m", 4, chain=True)
    assert body["previous_response_id"] == "resp_1" and body["store"] is True
    assert [item["content"][0]["text"] for item in body["input"]] == ["u1"]
    assert body["instructions"] == "You are a coding agent."  # vLLM does not carry them over

    history.answered("")  # that turn failed: nothing stored; the next one sends it again after resp_1
    history.texts.append("u2")
    body = request_body("responses", history, "m", 4, chain=True)
    assert body["previous_response_id"] == "resp_1"
    assert [item["content"][0]["text"] for item in body["input"]] == ["u1", "", "u2"]


def test_a_chain_is_only_for_the_responses_api() -> None:
    with pytest.raises(ValueError, match="responses API"):
        request_body("messages", _history("u0"), "m", 4, chain=True)
    with pytest.raises(ValueError, match="responses API"):
        SessionPlan(AgentWorkload(), "m", api="chat", responses_chain=True)


def test_http_error_details() -> None:
    not_found = {"error": {"message": "Response with id 'resp_97fd2fbf' not found.", "code": 404}}
    assert http_error_detail(json.dumps(not_found)) == "Response with id 'resp_*' not found."
    anthropic = {
        "type": "error",
        "error": {"type": "NotFoundError", "message": "The model `x` does not exist."},
    }
    assert http_error_detail(json.dumps(anthropic)) == "The model `x` does not exist."
    assert http_error_detail('{"detail":"Not Found"}') == '{"detail":"Not Found"}'
    assert http_error_detail("x" * 300) == "x" * 200


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _serve(status: int, body: str, content_type: str = "text/event-stream") -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.Response(status=status, text=body, content_type=content_type)

    return handle


def _turn(api: Api, handler: Handler) -> Reply:
    async def run() -> Reply:
        app = web.Application()
        app.router.add_post("/v1/responses", handler)
        app.router.add_post("/v1/messages", handler)
        async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as http:
            body = request_body(api, _history("u0"), "tiny-llama", 4)
            return await stream_turn(http, str(server.make_url("")).rstrip("/"), api, body, {})

    return asyncio.run(run())


@pytest.mark.parametrize(
    ("api", "name"), [("responses", "responses_stream"), ("messages", "messages_stream")]
)
def test_a_turn_read_over_http_and_cut_before_its_last_event(api: Api, name: str) -> None:
    stream = _captured(name)["answer"]
    whole = _turn(api, _serve(200, stream))
    assert whole.outcome.status == "ok", whole.outcome.error
    assert 0 < whole.outcome.ttft_s <= whole.outcome.e2e_s and whole.outcome.prompt_tokens > 0
    assert whole.text and whole.response_id == ("resp_cap_s" if api == "responses" else "")

    last = "response.completed" if api == "responses" else "message_stop"
    cut = _turn(api, _serve(200, stream[: stream.index(f"event: {last}")]))
    assert cut.outcome == TurnOutcome("failed", error=f"stream ended without {last}")


def test_refusals_and_failures_over_http() -> None:
    busy = _turn("messages", _serve(429, '{"error":{"message":"queue full"}}', "application/json"))
    assert (busy.outcome.status, busy.outcome.error) == ("rejected", "HTTP 429: queue full")
    answer = _captured("error_previous_unknown")["answer"]
    gone = _turn("responses", _serve(404, json.dumps(answer), "application/json"))
    assert gone.outcome.status == "failed" and gone.outcome.error.startswith("HTTP 404: Response with id")
