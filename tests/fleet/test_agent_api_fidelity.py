"""The simulated fleet's Responses and Anthropic Messages APIs against a capture from real vLLM 0.32
(tests/fixtures/vllm/agent_api_capture.json, scripts/capture_agent_api_fixtures.py).

Every captured request is replayed, in order, against one simulated instance configured like the captured
server (32-token blocks, max_model_len 4096, the store on, prompt tokens details on). Texts differ (random
weights against our sampler), and so do ids; everything else must match: statuses, content types, every
body and event key for key and value for value with ids and texts masked, the event sequences, error bodies
word for word, and the usage, cached tokens included (the same tokenization gives the same prompts, and the
same cache gives the same hits). Where real vLLM stopped early on EOS, the replay asks for as many tokens.
"""

from __future__ import annotations

import http.client
import itertools
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvroute.processes import FleetPorts, running_fleet

CAPTURE = json.loads(
    (Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "agent_api_capture.json").read_text()
)
RECORDED = {r["name"]: r for r in CAPTURE["requests"]}
ENGINE_ARGS = [
    "--model",
    CAPTURE["model"],
    "--block-size",
    str(CAPTURE["block_size"]),
    "--max-model-len",
    str(CAPTURE["max_model_len"]),
    "--prefill-tps",
    "1000000",
    "--decode-tps",
    "5000",
    "--enable-prompt-tokens-details",
]
# Values that are random or generated text, in vLLM and here alike
VOLATILE = frozenset({"id", "created_at", "text", "delta", "item_id"})
# Prompts that hold a previous answer's text: their lengths follow that text (their cached tokens do not)
FOLLOW_UPS = {"responses_followup", "responses_followup_stream", "responses_followup_chain"}
PROMPT_LENGTHS = frozenset({"input_tokens", "total_tokens", "cache_write_tokens"})


@dataclass
class Answer:
    status: int
    content_type: str
    body: Any  # JSON, or the text of an event stream
    broken: bool = False


def _call(url: str, recorded: dict[str, Any], body: Any) -> Answer:
    data, ctype = None, "application/json"
    if "raw_request" in recorded:
        data, ctype = recorded["raw_request"].encode(), recorded["request_content_type"]
    elif body is not None:
        data = json.dumps(body).encode()
    headers = {"content-type": ctype} if data is not None else {}
    request = urllib.request.Request(url, data, headers, method=recorded["method"])
    broken = False
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, content_type = response.status, response.headers.get("content-type", "")
            try:
                payload = response.read()
            except http.client.IncompleteRead as cut:
                payload, broken = cut.partial, True
    except urllib.error.HTTPError as error:
        status, content_type, payload = error.code, error.headers.get("content-type", ""), error.read()
    text = payload.decode()
    answer = json.loads(text) if content_type.startswith("application/json") else text
    return Answer(status, content_type, answer, broken)


def _output_tokens(recorded: dict[str, Any]) -> int | None:
    """How many tokens real vLLM generated, where it stopped before its budget (EOS)."""
    answer = recorded["answer"]
    if isinstance(answer, dict) and answer.get("status") == "completed":
        return int(answer["usage"]["output_tokens"])
    if isinstance(answer, dict) and answer.get("stop_reason") == "end_turn":
        return int(answer["usage"]["output_tokens"])
    return None


def _replayed_body(recorded: dict[str, Any]) -> Any:
    body = recorded.get("request")
    if (count := _output_tokens(recorded)) is not None:
        budget = "max_tokens" if recorded["path"].startswith("/v1/messages") else "max_output_tokens"
        return {**recorded["request"], budget: count}
    return body


@pytest.fixture(scope="module")
def replayed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Answer]]:
    ports, answers = FleetPorts.allocate(1), {}
    with running_fleet(ports, tmp_path_factory.mktemp("agent-api-fleet"), ENGINE_ARGS):
        base = f"http://127.0.0.1:{ports.http}"
        for name, recorded in RECORDED.items():
            url = base + recorded["path"]
            answer = _call(url, recorded, _replayed_body(recorded))
            if recorded["method"] == "GET" and _still_running(answer) and not _still_running(recorded):
                answer = _polled(url, recorded)  # the capture waited for a background run's end
            answers[name] = answer
    yield answers


def _still_running(answer: Answer | dict[str, Any]) -> bool:
    body = answer.body if isinstance(answer, Answer) else answer["answer"]
    return isinstance(body, dict) and body.get("status") in ("queued", "in_progress")


def _polled(url: str, recorded: dict[str, Any]) -> Answer:
    deadline = time.monotonic() + 30
    answer = _call(url, recorded, None)
    while _still_running(answer) and time.monotonic() < deadline:
        time.sleep(0.05)
        answer = _call(url, recorded, None)
    return answer


def masked(value: Any, volatile: frozenset[str] = VOLATILE) -> Any:
    if isinstance(value, dict):
        return {key: "*" if key in volatile else masked(item, volatile) for key, item in value.items()}
    if isinstance(value, list):
        return [masked(item, volatile) for item in value]
    return value


def events(stream: str) -> list[tuple[str, dict[str, Any]]]:
    """An SSE text as (event, data) pairs."""
    found = []
    for frame in stream.split("\n\n"):
        if not frame.strip():
            continue
        event_line, data_line = frame.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: "), frame
        found.append((event_line[7:], json.loads(data_line[6:])))
    return found


def _collapsed(kinds: list[str]) -> list[str]:
    """Runs of deltas as one: vLLM holds back a token that ends inside a UTF-8 character, the fleet's
    tokens are whole characters, so the counts of deltas may differ."""
    return [kind for kind, _ in itertools.groupby(kinds)]


def _comparable(name: str, body: Any) -> Any:
    return masked(body, VOLATILE | PROMPT_LENGTHS if name in FOLLOW_UPS else VOLATILE)


@pytest.mark.parametrize("name", list(RECORDED))
def test_status_and_content_type_match_vllm(replayed: dict[str, Answer], name: str) -> None:
    recorded, ours = RECORDED[name], replayed[name]
    assert ours.status == recorded["status"]
    assert ours.content_type.split(";")[0] == recorded["content_type"].split(";")[0]
    assert ours.broken == recorded.get("broken", False)


JSON_ANSWERS = [n for n, r in RECORDED.items() if r["content_type"].startswith("application/json")]


@pytest.mark.parametrize("name", JSON_ANSWERS)
def test_json_bodies_match_vllm_ids_and_texts_aside(replayed: dict[str, Answer], name: str) -> None:
    """Key order included: the bodies are compared as JSON texts."""
    ours, real = _comparable(name, replayed[name].body), _comparable(name, RECORDED[name]["answer"])
    assert json.dumps(ours) == json.dumps(real)


STREAMS = [
    n for n, r in RECORDED.items() if r["content_type"].startswith("text/event-stream") and r["answer"]
]


@pytest.mark.parametrize("name", STREAMS)
def test_event_streams_match_vllm(replayed: dict[str, Answer], name: str) -> None:
    ours, real = events(replayed[name].body), events(RECORDED[name]["answer"])
    assert _collapsed([kind for kind, _ in ours]) == _collapsed([kind for kind, _ in real])
    assert all(kind == data["type"] for kind, data in ours)
    deltas = [kind for kind, _ in ours if kind.endswith("delta") and kind != "message_delta"]
    output_tokens = max(len(deltas), 1)
    real_deltas = [kind for kind, _ in real if kind.endswith("delta") and kind != "message_delta"]
    assert len(real_deltas) <= output_tokens
    first = {kind: data for kind, data in reversed(ours)}
    real_first = {kind: data for kind, data in reversed(real)}
    for kind, data in first.items():
        if kind in ("response.output_text.delta", "content_block_delta"):
            assert masked(data).keys() == masked(real_first[kind]).keys()
            continue
        # the sequence numbers after the deltas follow their count
        comparable = {k: v for k, v in _comparable(name, data).items() if k != "sequence_number"}
        real_comparable = {
            k: v for k, v in _comparable(name, real_first[kind]).items() if k != "sequence_number"
        }
        assert json.dumps(comparable) == json.dumps(real_comparable), kind


@pytest.mark.parametrize("name", [n for n in STREAMS if n.startswith(("responses", "background"))])
def test_response_events_are_numbered_from_where_they_start(replayed: dict[str, Answer], name: str) -> None:
    ours, real = events(replayed[name].body), events(RECORDED[name]["answer"])
    numbers = [data["sequence_number"] for _, data in ours]
    assert numbers[0] == real[0][1]["sequence_number"]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
    assert ours[-1][0] == "response.completed"


def test_the_body_request_id_is_the_response_id(replayed: dict[str, Answer]) -> None:
    for name in ("responses", "responses_followup", "responses_store_false", "background", "retrieve"):
        assert replayed[name].body["id"] == RECORDED[name]["answer"]["id"], name
    assert events(replayed["responses_stream"].body)[0][1]["response"]["id"] == "resp_cap_s"


def test_a_follow_up_finds_the_previous_turn_cached(replayed: dict[str, Answer]) -> None:
    """Its prompt holds the previous prompt whole: the previous prompt's full blocks are hits."""
    for name in ("responses_followup", "responses_followup_chain"):
        ours, real = replayed[name].body["usage"], RECORDED[name]["answer"]["usage"]
        assert ours["input_tokens_details"]["cached_tokens"] == real["input_tokens_details"]["cached_tokens"]
    previous = replayed["responses"].body["usage"]["input_tokens"]
    followup = replayed["responses_followup"].body["usage"]
    assert followup["input_tokens_details"]["cached_tokens"] == previous // 32 * 32
    assert followup["input_tokens"] > previous
