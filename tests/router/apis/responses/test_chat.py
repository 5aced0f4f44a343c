"""A Responses body's prompt, token for token as real vLLM 0.32 renders it.

The fixture holds what a real vLLM answered (scripts/capture_responses_renders.py): the ids of
``/v1/responses/render`` for single requests, the refusals, and ``previous_response_id`` chains created with
the store on (each turn's prompt ids, and the output the next turn's prompt includes).
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import pytest

from router.apis.responses.chat import ResponsesChat, responses_chat
from router.prompt.chat_conversation import InvalidPrompt, engine_conversation
from router.prompt.token_cache import CachedChatTokenizer
from router.prompt.tokenization import PromptTokenizer

CAPTURE = json.loads(
    (Path(__file__).parents[3] / "fixtures" / "vllm" / "responses_render_capture.json").read_text()
)
RENDERS = {case["name"]: case for case in CAPTURE["renders"]}
CHAINS = {case["name"]: case["turns"] for case in CAPTURE["chains"]}
RENDERED = sorted(name for name, case in RENDERS.items() if case["status"] == 200)
REFUSED = sorted(name for name, case in RENDERS.items() if case["status"] != 200)
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def cached(tokenizer: PromptTokenizer) -> CachedChatTokenizer:
    """The router's tokenizer: a Responses prompt's BOS put before the chat's cached ids."""
    return CachedChatTokenizer(tokenizer)


def engine_ids(tokenizer: PromptTokenizer | CachedChatTokenizer, chat: ResponsesChat) -> list[int]:
    return chat.token_ids(tokenizer)


@pytest.mark.parametrize("name", RENDERED)
def test_a_request_renders_the_ids_vllm_renders(
    tokenizer: PromptTokenizer, cached: CachedChatTokenizer, name: str
) -> None:
    case = RENDERS[name]
    body = copy.deepcopy(case["body"])
    assert engine_ids(tokenizer, responses_chat(body)) == case["token_ids"]
    assert engine_ids(cached, responses_chat(body)) == case["token_ids"]
    assert body == case["body"]  # the body is read, never changed


@pytest.mark.parametrize("name", REFUSED)
def test_what_vllm_refuses_is_no_prompt(name: str) -> None:
    with pytest.raises(InvalidPrompt):
        responses_chat(RENDERS[name]["body"])


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_each_turn_of_a_chain_renders_from_the_previous_turns(
    tokenizer: PromptTokenizer, cached: CachedChatTokenizer, name: str
) -> None:
    previous: ResponsesChat | None = None
    output: list[Any] = []
    for turn in CHAINS[name]:
        chat = responses_chat(turn["body"], previous.messages if previous else (), output)
        assert engine_ids(tokenizer, chat) == turn["token_ids"]
        assert engine_ids(cached, chat) == turn["token_ids"]  # the earlier turns' ids reused
        previous, output = chat, turn["output"]


def test_the_capture_shows_what_vllm_ignores_and_what_it_reads() -> None:
    def ids(name: str) -> list[int]:
        return list(RENDERS[name]["token_ids"])

    plain = ids("ignored_fields")
    assert plain[:2] == [0, 0]  # the template's BOS, and the one the tokenizer adds
    for name in ("only_web_search", "reasoning_summary_no_effort", "template_kwargs_thinking_null"):
        assert ids(name) == plain, name
    assert ids("reasoning_effort_none") == ids("template_kwargs_thinking_off") != plain
    assert ids("tool_choice_none_still_shown") == ids("web_search_dropped") != plain
    assert len(RENDERED) >= 35 and len(REFUSED) >= 5


def test_parallel_calls_join_one_assistant_message_in_the_order_vllm_builds() -> None:
    chat = responses_chat(RENDERS["parallel_calls"]["body"])
    assistant = chat.messages[1]
    assert list(assistant) == ["role", "tool_calls"]
    assert [list(call) for call in assistant["tool_calls"]] == [["id", "function", "type"]] * 2
    assert [list(call["function"]) for call in assistant["tool_calls"]] == [["name", "arguments"]] * 2
    assert [message["role"] for message in chat.messages] == ["user", "assistant", "tool", "tool", "user"]


def test_reasoning_and_text_fill_the_message_they_follow() -> None:
    chat = responses_chat(RENDERS["message_then_reasoning"]["body"])
    assert chat.messages[1:] == [
        {"role": "assistant", "content": "first", "reasoning": "after"},
        {"role": "assistant", "reasoning": "again"},
    ]


def test_history_drops_system_messages_and_everything_but_output_text() -> None:
    previous = [{"role": "system", "content": "old"}, {"role": "developer", "content": "d"}]
    output = [
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "r"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}] * 2},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
    ]
    chat = responses_chat({"input": "next", "previous_response_id": "resp_1"}, previous, output)
    assert chat.messages == [
        {"role": "developer", "content": "d"},
        {"role": "assistant", "content": "a"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "next"},
    ]


def test_a_first_call_after_the_history_starts_its_own_message() -> None:
    previous = [{"role": "assistant", "content": "x"}]
    body = {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]}
    chat = responses_chat(body, previous)
    assert len(chat.messages) == 2 and "tool_calls" not in chat.messages[0]


def test_tools_left_out_for_tool_choice_none_only_with_the_server_flag() -> None:
    body = RENDERS["tool_choice_none_still_shown"]["body"]
    assert responses_chat(body).tools is not None
    assert responses_chat(body, exclude_tools_when_tool_choice_none=True).tools is None
    assert responses_chat({**body, "tool_choice": "auto"}, exclude_tools_when_tool_choice_none=True).tools


def test_only_unshown_tools_give_an_empty_list_and_no_tools_none() -> None:
    assert responses_chat(RENDERS["only_web_search"]["body"]).tools == []
    assert responses_chat({"input": "hi", "tools": []}).tools is None
    assert responses_chat({"input": "hi"}).tools is None


def test_template_kwargs_merge_the_reasoning_effort_under_the_requests_own() -> None:
    kwargs = responses_chat(RENDERS["reasoning_effort_none_thinking_kwarg_wins"]["body"]).template_kwargs
    assert kwargs == {"enable_thinking": True, "reasoning_effort": "none"}
    assert responses_chat({"input": "x", "reasoning": {"effort": "high"}}).template_kwargs == {
        "reasoning_effort": "high",
        "enable_thinking": True,
    }
    overridden = RENDERS["template_kwargs_generation_flag_overridden"]["body"]
    assert responses_chat(overridden).template_kwargs == {"unused": 1}
    assert responses_chat({"input": "x", "reasoning": None}).template_kwargs is None


def test_calls_as_given_keep_their_fields_and_parse_only_the_arguments() -> None:
    call: dict[str, Any] = {
        "type": "function",
        "function": {"name": "f", "arguments": '{"b": 1, "a": 2}'},
        "id": "c",
    }
    dict_call = {"id": "d", "function": {"name": "g", "arguments": {"k": []}}}
    odd = [{"id": "e", "function": {"name": "h", "arguments": text}} for text in ("nope", "[1]", "", None)]
    message = {"role": "assistant", "content": None, "tool_calls": [call, dict_call, *odd]}
    [built] = engine_conversation([message], TEMPLATE, calls_as_given=True)
    given, as_dict, *rest = built["tool_calls"]
    assert list(given) == ["type", "function", "id"] and list(given["function"]) == ["name", "arguments"]
    assert list(given["function"]["arguments"].items()) == [("b", 1), ("a", 2)]
    assert as_dict["function"]["arguments"] == {"k": []}
    assert [odd_call["function"]["arguments"] for odd_call in rest] == [{}] * 4
    assert call["function"]["arguments"] == '{"b": 1, "a": 2}'  # the message itself is left as it was
    [chat] = engine_conversation([message | {"tool_calls": [call]}], TEMPLATE)
    assert list(chat["tool_calls"][0]) == ["id", "function", "type"]  # the chat request model's order
    assert list(chat["tool_calls"][0]["function"]) == ["arguments", "name"]


ASK = {"role": "user", "content": "hi"}
OUT = {"type": "output_text", "text": "x"}


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"input": 5},
        {"input": None},
        {"input": ["text"]},
        {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
        {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": 3}]}]},
        {"input": [{"role": "user", "content": {"text": "x"}}]},
        {"input": [{"role": "tool", "content": "x", "tool_call_id": "c"}]},
        {"input": [ASK, {"type": "item_reference", "id": "msg_1"}]},
        {"input": [ASK, {"type": "web_search_call", "id": "ws", "status": "completed"}]},
        {"input": [ASK, {"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]},
        {"input": [ASK, {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "r"}]}]},
        {"input": [ASK, {"type": "reasoning", "summary": [{"type": "summary_text"}]}]},
        {
            "input": [
                ASK,
                {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
            ]
        },
        {"input": [ASK, {"type": "message", "role": "assistant", "content": []}]},
        {"input": [ASK, {"type": "message", "role": "assistant", "content": [OUT], "status": "odd"}]},
        {"input": [ASK, {"type": "message", "role": "assistant", "content": [OUT], "status": None}]},
        {"input": [ASK, {"type": "message", "role": "assistant", "content": [OUT | {"annotations": [1]}]}]},
        {
            "input": [
                ASK,
                {"type": "message", "role": "assistant", "content": "x", "id": "m", "status": "completed"},
            ]
        },
        {"input": [ASK, {"type": "reasoning", "summary": [], "encrypted_content": {}}]},
        {"input": [ASK, {"type": "function_call", "call_id": "c", "name": "f"}]},
        {"input": [ASK, {"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
        {"input": [ASK, {"type": "function_call", "call_id": 1, "name": "f", "arguments": "{}"}]},
        {"input": [ASK, {"type": "custom_tool_call", "call_id": "c", "name": "f", "input": None}]},
        {"input": [ASK, {"type": "custom_tool_call_output", "output": "o"}]},
        {"input": [ASK, {"type": "function_call_output", "call_id": "c", "output": None}]},
        {"input": "x", "instructions": ["a"]},
        {"input": "x", "tools": {"type": "function"}},
        {"input": "x", "tools": [{"name": "f"}]},
        {"input": "x", "tools": [{"type": "function"}]},
        {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": "schema"}]},
        {"input": "x", "tools": [{"type": "function", "name": "f", "strict": "yes"}]},
        {"input": "x", "tools": [{"type": "custom", "name": "g", "format": {"type": "grammar"}}]},
        {"input": "x", "tools": [{"type": "namespace", "name": "n", "tools": []}]},
        {
            "input": "x",
            "tools": [{"type": "namespace", "name": "n", "description": "d", "tools": [{"type": "x"}]}],
        },
        {"input": "x", "reasoning": {"effort": "extreme"}},
        {"input": "x", "reasoning": "high"},
        {"input": "x", "chat_template_kwargs": ["a"]},
        {"input": "x", "kv_transfer_params": {"prompt_token_ids": [1, 2]}},
        {"input": "x", "previous_response_id": "resp_1"},
    ],
)
def test_what_is_not_reproduced_is_invalid(body: dict[str, Any]) -> None:
    with pytest.raises(InvalidPrompt):
        responses_chat(body)


def test_an_input_image_by_url_passes_to_the_chat_as_vllms_parser_reads_it() -> None:
    image = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo=", "detail": "auto"}
    content = [{"type": "input_text", "text": "look"}, image]
    chat = responses_chat({"input": [{"role": "user", "content": content}]})
    assert chat.messages[-1]["content"] == content


@pytest.mark.parametrize(
    ("previous", "output"),
    [
        (["text"], []),
        ([{"content": "x"}], []),
        ([ASK], ["item"]),
        ([ASK], [{"type": "message", "content": "x"}]),
        ([ASK], [{"type": "message", "content": [{"type": "refusal", "refusal": "no"}]}]),
    ],
)
def test_a_malformed_history_is_invalid(previous: list[Any], output: list[Any]) -> None:
    with pytest.raises(InvalidPrompt):
        responses_chat({"input": "x", "previous_response_id": "resp_1"}, previous, output)


ODD_VALUES: list[Any] = [None, 0, 1.5, True, "", "x", [], [None], {}, {"type": None}, {"type": []}, [[1]]]


def _mutations(value: Any, rng: random.Random) -> Any:
    """value with one of its nested values (or itself) replaced by an odd one."""
    if isinstance(value, dict) and value and rng.random() < 0.8:
        key = rng.choice(sorted(value))
        return {**value, key: _mutations(value[key], rng)}
    if isinstance(value, list) and value and rng.random() < 0.8:
        index = rng.randrange(len(value))
        return [*value[:index], _mutations(value[index], rng), *value[index + 1 :]]
    return rng.choice(ODD_VALUES)


def test_odd_json_raises_invalid_prompt_and_nothing_else(tokenizer: PromptTokenizer) -> None:
    rng = random.Random(41)
    bodies = [case["body"] for case in CAPTURE["renders"]]
    for _ in range(3000):
        body = _mutations(rng.choice(bodies), rng)
        try:
            engine_ids(tokenizer, responses_chat(body))
        except InvalidPrompt:
            pass
