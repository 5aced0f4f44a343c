"""The agents' own APIs through kvroute, driven by the official SDKs (issue 41): OpenAI's Responses API
(`openai`: create, stream, previous_response_id chains, retrieve, cancel) and Anthropic's Messages API
(`anthropic`: create, stream, tools, count_tokens), over a simulated fleet of 2 instances that stores
responses and reports its prefix hits.

A conversation stays on one instance, and the router's predicted cached blocks (`x-kvroute-cached-blocks`)
are what the engine then reports cached, turn after turn. The helpers here drive the same conversations
against the real stack (tests/stack/test_agent_apis.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from anthropic.types import Message
from openai.types.responses import Response

from kvroute.processes import Child, FleetPorts, running_router, start, wait_all_healthy
from kvroute.workload import AgentWorkload
from tests.stack.client import metric, wait_steady

MODEL = "tiny-llama"
BLOCK = 32
INSTANCE_HEADER = "x-kvroute-instance"
CACHED_BLOCKS_HEADER = "x-kvroute-cached-blocks"
PROMPT_BLOCKS_HEADER = "x-kvroute-prompt-blocks"
# The fleet's answers say what was cached (the Anthropic usage's cache fields need it), and it stores
# responses as vLLM does with VLLM_ENABLE_RESPONSES_API_STORE=1.
FLEET_ARGS = [
    "--prefill-tps",
    "200000",
    "--decode-tps",
    "1000",
    "--enable-prompt-tokens-details",
    "--enable-responses-api-store",
]
TURNS = 10
MAX_OUTPUT = 8  # a random-weight model rarely stops by itself
LONG_OUTPUT = 2000  # a background response still generating when it is cancelled
CANCEL_TRIES = 3
WORKLOAD = AgentWorkload(system_prompt_words=200, min_turn_words=10, max_turn_words=30)
NOT_FOUND_TYPE = "invalid_request_error"
WEATHER: dict[str, Any] = {
    "name": "get_weather",
    "description": "The weather in a city now.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@dataclass(frozen=True)
class Turn:
    """One answer: where the router sent it and what it predicted, beside what the engine reported."""

    instance: str
    predicted_blocks: int
    prompt_blocks: int
    prompt_tokens: int  # the engine's count
    cached_tokens: int  # the engine's prefix hits

    @classmethod
    def of(cls, headers: Mapping[str, str], prompt_tokens: int, cached_tokens: int | None) -> Turn:
        assert cached_tokens is not None, "the answer's usage does not say what was cached"
        return cls(
            headers[INSTANCE_HEADER],
            int(headers[CACHED_BLOCKS_HEADER]),
            int(headers[PROMPT_BLOCKS_HEADER]),
            prompt_tokens,
            cached_tokens,
        )


Settle = Callable[[str], None]  # called with the instance after each turn, before the next


def settled(router: str, quiet_s: float = 0.3) -> Settle:
    """Waits, after a turn, until the router's index has taken in the KV events of that turn (an agent's
    next turn follows at once, but the events race the answer to the router on a loaded machine)."""

    def settle(instance: str) -> None:
        wait_steady(lambda: metric(router, "kvroute_index_blocks", vllm_instance=instance), quiet_s=quiet_s)

    return settle


def assert_one_instance_predicted_exactly(turns: Sequence[Turn]) -> None:
    """Every turn on the first one's instance, predicted hits = the engine's, and the prefix really reused."""
    assert [t.instance for t in turns] == [turns[0].instance] * len(turns), turns
    assert [t.predicted_blocks * BLOCK for t in turns] == [t.cached_tokens for t in turns], turns
    assert [t.prompt_blocks for t in turns] == [t.prompt_tokens // BLOCK for t in turns], turns
    assert all(t.cached_tokens > 0 for t in turns[1:]), turns


def not_found_body(response_id: str) -> dict[str, Any]:
    """vLLM's answer for a response id it does not hold (serving.py _make_not_found_error)."""
    return {
        "message": f"Response with id '{response_id}' not found.",
        "type": NOT_FOUND_TYPE,
        "param": "response_id",
        "code": 404,
    }


# --- Responses ---------------------------------------------------------------------------------------


def streamed_response(client: openai.OpenAI, **body: Any) -> tuple[Response, Mapping[str, str]]:
    """create(stream=True): the response its response.completed event carries, and the answer's headers."""
    stream = client.responses.create(stream=True, **body)
    with stream:
        events = list(stream)
    types = [event.type for event in events]
    assert types[0] == "response.created" and types[-1] == "response.completed", types
    assert [event.sequence_number for event in events] == list(range(len(events)))
    completed = events[-1]
    assert completed.type == "response.completed"
    return completed.response, stream.response.headers


def whole_response(client: openai.OpenAI, **body: Any) -> tuple[Response, Mapping[str, str]]:
    raw = client.responses.with_raw_response.create(**body)
    return raw.parse(), raw.headers


def responses_chain(client: openai.OpenAI, turns: int, settle: Settle) -> list[Turn]:
    """A chain of previous_response_id turns, every other one streamed. The instructions come every turn
    (vLLM keeps no earlier turn's), so each prompt extends the one before."""
    seen: list[Turn] = []
    previous: str | None = None
    for turn in range(turns):
        body: dict[str, Any] = {
            "model": MODEL,
            "instructions": WORKLOAD.system_prompt(),
            "input": WORKLOAD.user_message(0, turn),
            "max_output_tokens": MAX_OUTPUT,
        }
        if previous is not None:
            body["previous_response_id"] = previous
        response, headers = (streamed_response if turn % 2 else whole_response)(client, **body)
        assert response.usage is not None and response.output, response
        assert response.previous_response_id == previous
        usage = response.usage
        seen.append(Turn.of(headers, usage.input_tokens, usage.input_tokens_details.cached_tokens))
        previous = response.id
        settle(seen[-1].instance)
    return seen


def check_create_stream_retrieve(client: openai.OpenAI) -> None:
    """Whole, streamed (both ways the SDK streams), then retrieved by id: the same stored response."""
    body: dict[str, Any] = {"model": MODEL, "input": "Say something.", "max_output_tokens": MAX_OUTPUT}
    whole, headers = whole_response(client, **body)
    assert whole.status == "incomplete" and whole.incomplete_details is not None  # stopped by max_output
    assert whole.usage is not None and whole.usage.output_tokens == MAX_OUTPUT
    assert whole.output_text and int(headers[PROMPT_BLOCKS_HEADER]) == whole.usage.input_tokens // BLOCK

    streamed, headers = streamed_response(client, **body)
    assert streamed.id != whole.id and streamed.usage is not None
    assert streamed.usage.input_tokens == whole.usage.input_tokens
    with client.responses.stream(**body) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == "".join(deltas) and final.usage is not None

    for stored in (whole, streamed, final):
        retrieved = client.responses.retrieve(stored.id)
        assert (retrieved.id, retrieved.status) == (stored.id, stored.status)
        assert retrieved.output_text == stored.output_text


def check_background_cancel(client: openai.OpenAI) -> None:
    """A background response is queued at once; cancelling it, on the instance generating it, stops it. One
    that reached its max_output_tokens before the cancel came (the tiny model on a machine whose other work
    delayed the cancel) is refused by vLLM as no longer running, and another is tried."""
    for _ in range(CANCEL_TRIES):
        queued = client.responses.create(
            model=MODEL,
            input="Write a long story.",
            max_output_tokens=LONG_OUTPUT,
            background=True,
            extra_body={"ignore_eos": True},  # no early stop before the cancel
        )
        assert queued.status in ("queued", "in_progress"), queued
        try:
            cancelled = client.responses.cancel(queued.id)
        except openai.BadRequestError as exc:
            ended = client.responses.retrieve(queued.id)
            reason = ended.incomplete_details.reason if ended.incomplete_details else None
            assert (ended.status, reason) == ("incomplete", "max_output_tokens"), f"{exc}: {ended}"
            continue
        assert (cancelled.id, cancelled.status) == (queued.id, "cancelled")
        assert client.responses.retrieve(queued.id).status == "cancelled"
        return
    raise AssertionError(f"each of {CANCEL_TRIES} background responses ended before its cancel came")


def check_background_stream_resumes(client: openai.OpenAI) -> None:
    """A background response's events, followed again from the middle (?stream=true&starting_after=N), come
    from the instance that holds them."""
    events = list(
        client.responses.create(
            model=MODEL, input="Tell a story.", max_output_tokens=8, background=True, stream=True
        )
    )
    assert events[-1].type == "response.completed"
    response_id = events[-1].response.id
    resumed = list(client.responses.retrieve(response_id, stream=True, starting_after=2))
    assert [e.sequence_number for e in resumed] == [
        e.sequence_number for e in events if e.sequence_number > 2
    ]
    assert resumed[-1].type == "response.completed"


def check_follow_up_not_found(client: openai.OpenAI, response_id: str) -> None:
    """A follow-up and a retrieval of a response no instance holds: vLLM's 404, NotFoundError, quickly."""
    started = time.monotonic()
    with pytest.raises(openai.NotFoundError) as follow_up:
        client.responses.create(
            model=MODEL, input="And then?", previous_response_id=response_id, max_output_tokens=MAX_OUTPUT
        )
    assert follow_up.value.response.json() == {"error": not_found_body(response_id)}
    with pytest.raises(openai.NotFoundError) as retrieval:
        client.responses.retrieve(response_id)
    assert retrieval.value.response.json() == {"error": not_found_body(response_id)}
    assert time.monotonic() - started < 10


# --- Anthropic Messages ------------------------------------------------------------------------------


def assistant_turn(answer: Message, tool_use_id: str | None) -> dict[str, Any]:
    """The answer as the next request's assistant message, with a call of the weather tool if tool_use_id."""
    content: list[Any] = [
        {"type": "text", "text": b.text} for b in answer.content if b.type == "text" and b.text
    ]
    content += [
        {"type": "tool_use", "id": b.id, "name": b.name, "input": b.input}
        for b in answer.content
        if b.type == "tool_use"
    ]
    if tool_use_id is not None:
        content.append(
            {"type": "tool_use", "id": tool_use_id, "name": "get_weather", "input": {"city": "Oslo"}}
        )
    return {"role": "assistant", "content": content or "ok"}


def user_turn(text: str, answered: Sequence[str]) -> dict[str, Any]:
    """The user's next message: the results of the calls the assistant just made, then text."""
    results: list[Any] = [
        {"type": "tool_result", "tool_use_id": call, "content": f"{call}: 4 C, light snow"}
        for call in answered
    ]
    return {"role": "user", "content": [*results, {"type": "text", "text": text}]}


def pending_calls(message: dict[str, Any]) -> list[str]:
    content = message["content"]
    return [] if isinstance(content, str) else [b["id"] for b in content if b["type"] == "tool_use"]


def anthropic_prompt_tokens(answer: Message) -> int:
    usage = answer.usage
    return (
        usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)
    )


def send_message(client: anthropic.Anthropic, stream: bool, **body: Any) -> tuple[Message, Mapping[str, str]]:
    if stream:
        with client.messages.stream(**body) as streaming:
            text = "".join(streaming.text_stream)
            answer = streaming.get_final_message()
            headers = streaming.response.headers
        assert text == "".join(b.text for b in answer.content if b.type == "text")
        return answer, headers
    raw = client.messages.with_raw_response.create(**body)
    return raw.parse(), raw.headers


def messages_conversation(client: anthropic.Anthropic, turns: int, settle: Settle) -> list[Turn]:
    """A conversation with the weather tool: every third answer calls it (tool_use, then tool_result in the
    next user message), every other turn streamed."""
    seen: list[Turn] = []
    messages: list[dict[str, Any]] = [user_turn(WORKLOAD.user_message(1, 0), ())]
    for turn in range(turns):
        body: dict[str, Any] = {
            "model": MODEL,
            "system": WORKLOAD.system_prompt(),
            "messages": messages,
            "tools": [WEATHER],
        }
        answer, headers = send_message(client, bool(turn % 2), max_tokens=MAX_OUTPUT, **body)
        assert answer.stop_reason in ("max_tokens", "end_turn", "tool_use"), answer
        usage = answer.usage
        seen.append(Turn.of(headers, anthropic_prompt_tokens(answer), usage.cache_read_input_tokens))
        settle(seen[-1].instance)
        assistant = assistant_turn(answer, f"toolu_{turn:02d}" if turn % 3 == 0 else None)
        messages = [
            *messages,
            assistant,
            user_turn(WORKLOAD.user_message(1, turn + 1), pending_calls(assistant)),
        ]
    assert any(pending_calls(m) for m in messages) and any(
        not isinstance(m["content"], str) and any(b["type"] == "tool_result" for b in m["content"])
        for m in messages
    )
    return seen


def check_messages_create_stream_count(client: anthropic.Anthropic) -> None:
    """create and stream answer alike; count_tokens counts the prompt the engine counted."""
    messages: list[dict[str, Any]] = [
        user_turn("What is the weather in Oslo?", ()),
        assistant_turn(_text_message("Let me look."), "toolu_a"),
        user_turn("Thanks.", ["toolu_a"]),
    ]
    body: dict[str, Any] = {
        "model": MODEL,
        "system": WORKLOAD.system_prompt(),
        "messages": messages,
        "tools": [WEATHER],
    }
    whole, headers = send_message(client, False, max_tokens=MAX_OUTPUT, **body)
    assert whole.type == "message" and whole.role == "assistant" and whole.content
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == MAX_OUTPUT
    prompt_tokens = anthropic_prompt_tokens(whole)
    assert int(headers[PROMPT_BLOCKS_HEADER]) == prompt_tokens // BLOCK

    streamed, headers = send_message(client, True, max_tokens=MAX_OUTPUT, **body)
    assert streamed.usage.output_tokens == MAX_OUTPUT and anthropic_prompt_tokens(streamed) == prompt_tokens
    assert streamed.usage.cache_read_input_tokens == int(headers[CACHED_BLOCKS_HEADER]) * BLOCK > 0

    counted = client.messages.count_tokens(**body)
    assert counted.input_tokens == prompt_tokens


def _text_message(text: str) -> Message:
    return Message.model_validate(
        {
            "id": "msg_0",
            "type": "message",
            "role": "assistant",
            "model": MODEL,
            "content": [{"type": "text", "text": text}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
    )


# --- The simulated fleet -----------------------------------------------------------------------------


def fleet_command(ports: FleetPorts, index: int) -> list[str]:
    """Instance index of ports' fleet alone, in its own process (so that it can be stopped alone)."""
    return [*ports.instance_args(index), *FLEET_ARGS]


@contextlib.contextmanager
def running_instances(ports: FleetPorts, log_dir: Path) -> Iterator[list[Child]]:
    children: list[Child] = []
    try:
        for index in range(ports.count):
            children.append(start(f"fleet-{index}", fleet_command(ports, index), log_dir))
        wait_all_healthy(list(zip(children, ports.health_urls(), strict=True)))
        yield children
    finally:
        for child in children:
            child.stop()


@dataclass
class Fleet:
    router: str
    instances: list[Child]  # fleet-0, fleet-1

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.router + "/v1", api_key="unused", max_retries=0, timeout=30)

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.router, api_key="unused", max_retries=0, timeout=30)


@contextlib.contextmanager
def fleet_and_router(log_dir: Path) -> Iterator[Fleet]:
    ports = FleetPorts.allocate(2)
    with running_instances(ports, log_dir / "fleet") as children:
        with running_router(ports.router_config(), log_dir / "router") as url:
            yield Fleet(url, children)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with fleet_and_router(tmp_path_factory.mktemp("agent-sdks")) as running:
        yield running


def test_responses_create_stream_and_retrieve(fleet: Fleet) -> None:
    check_create_stream_retrieve(fleet.openai())


def test_responses_chain_stays_on_one_instance_with_predicted_hits(fleet: Fleet) -> None:
    assert_one_instance_predicted_exactly(responses_chain(fleet.openai(), TURNS, settled(fleet.router)))


def test_responses_background_cancel(fleet: Fleet) -> None:
    check_background_cancel(fleet.openai())


def test_a_background_stream_resumes_through_the_router(fleet: Fleet) -> None:
    check_background_stream_resumes(fleet.openai())


def test_unknown_response_id_is_not_found(fleet: Fleet) -> None:
    check_follow_up_not_found(fleet.openai(), "resp_nope")


def test_messages_create_stream_and_count_tokens(fleet: Fleet) -> None:
    check_messages_create_stream_count(fleet.anthropic())


def test_messages_conversation_with_tools_stays_on_one_instance_with_predicted_hits(fleet: Fleet) -> None:
    assert_one_instance_predicted_exactly(
        messages_conversation(fleet.anthropic(), TURNS, settled(fleet.router))
    )


def test_stopped_holder_gives_not_found(tmp_path: Path) -> None:
    with fleet_and_router(tmp_path) as own:
        client = own.openai()
        stored, headers = whole_response(
            client, model=MODEL, input="Remember this.", max_output_tokens=MAX_OUTPUT
        )
        holder = int(headers[INSTANCE_HEADER].removeprefix("fleet-"))
        own.instances[holder].stop()
        check_follow_up_not_found(client, stored.id)
