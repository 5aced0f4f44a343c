"""The conversation and tools the router hands the chat template, laid out as vLLM 0.32 lays them out.

tests/stack/test_tokenization.py compares the resulting ids with real vLLM's; these pin each rule on its own.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from router.prompt.chat_conversation import InvalidPrompt, engine_conversation, engine_messages, engine_tools

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def one(message: dict[str, Any], template: str = TEMPLATE) -> dict[str, Any]:
    [built] = engine_conversation([message], template)
    return built


def test_only_the_fields_vllm_keeps_reach_the_template() -> None:
    assert one({"role": "user", "content": "hi", "name": "dev", "extra": 1, "task": 3}) == {
        "role": "user",
        "content": "hi",
        "name": "dev",
    }
    assert one({"role": "tool", "content": "ok", "tool_call_id": None}) == {
        "role": "tool",
        "content": "ok",
        "tool_call_id": None,
    }


def test_text_parts_join_with_newlines_and_empty_ones_drop() -> None:
    parts = [
        {"type": "text", "text": "a"},
        {"type": "text", "text": ""},
        {"type": "input_text", "text": "b"},
        {"type": "text", "text": None},
        "c",
        {"type": "refusal", "refusal": "d"},
    ]
    assert one({"role": "user", "content": parts})["content"] == "a\nb\nc\nd"
    assert one({"role": "assistant", "content": None})["content"] == ""


@pytest.mark.parametrize(
    "content", [[{"type": "image_url", "image_url": {"url": "x"}}], [{"type": "text", "text": 3}], 7, [None]]
)
def test_what_is_not_text_is_no_prompt_here(content: Any) -> None:
    with pytest.raises(InvalidPrompt):
        one({"role": "user", "content": content})


def test_claude_codes_billing_header_leaves_system_text_only() -> None:
    header = "x-anthropic-billing-header: cch=1f2e\n"
    assert one({"role": "system", "content": header + "Be careful."})["content"] == "Be careful."
    parts = [{"type": "text", "text": header.strip()}, {"type": "text", "text": "Rules."}]
    assert one({"role": "system", "content": parts})["content"] == "Rules."
    assert one({"role": "user", "content": header + "x"})["content"] == header + "x"
    thinking = [{"type": "thinking", "thinking": header + "t"}]  # only plain text parts lose it
    assert one({"role": "system", "content": thinking})["content"] == header + "t"


def test_tool_calls_are_laid_out_in_the_request_models_order_with_arguments_parsed() -> None:
    call = {
        "index": 0,
        "type": "function",
        "function": {"x": 1, "arguments": '{"b": 1, "a": [2]}', "name": "f"},
        "id": "c1",
    }
    [built] = one({"role": "assistant", "content": "", "tool_calls": [call]})["tool_calls"]
    expected = {
        "id": "c1",
        "function": {"arguments": {"b": 1, "a": [2]}, "name": "f", "x": 1},
        "type": "function",
        "index": 0,
    }
    assert json.dumps(built) == json.dumps(expected)
    assert call["function"]["arguments"] == '{"b": 1, "a": [2]}'  # the request's own dict is left alone


@pytest.mark.parametrize("arguments", ["", "{not json", "[1, 2]", "42"])
def test_arguments_that_are_no_object_become_an_empty_one(arguments: str) -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    [built] = one({"role": "assistant", "content": "", "tool_calls": [call]})["tool_calls"]
    assert built["function"]["arguments"] == {}


def test_an_empty_tool_call_list_is_dropped_and_reasoning_is_passed_both_ways() -> None:
    built = one({"role": "assistant", "content": "ok", "tool_calls": [], "reasoning_content": "hm"})
    assert built == {"role": "assistant", "content": "ok", "reasoning": "hm", "reasoning_content": "hm"}


@pytest.mark.parametrize(
    "call",
    [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"id": "c", "type": "custom", "function": {"name": "f", "arguments": "{}"}},
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}},
        "call",
    ],
)
def test_tool_calls_beyond_the_request_model_are_no_prompt_here(call: Any) -> None:
    with pytest.raises(InvalidPrompt):
        one({"role": "assistant", "content": "", "tool_calls": [call]})


def test_developer_messages_merge_into_the_system_message_unless_the_template_names_them() -> None:
    messages = [
        {"role": "system", "content": "A."},
        {"role": "user", "content": "hi"},
        {"role": "developer", "content": "B.", "tools": None},
    ]
    assert engine_conversation(messages, TEMPLATE) == [
        {"role": "system", "content": "A.\n\nB."},
        {"role": "user", "content": "hi"},
    ]
    assert engine_conversation(messages, TEMPLATE + "{# 'developer' #}")[2] == {
        "role": "developer",
        "content": "B.",
        "tools": None,
    }
    assert engine_conversation(messages[2:], TEMPLATE) == [{"role": "system", "content": "B."}]


def test_tools_are_dumped_as_vllms_model_lays_them_out() -> None:
    tools = [
        {"type": "function", "x": 1, "function": {"parameters": {"type": "object"}, "name": "run", "y": 2}},
        {"function": {"name": "read", "strict": True, "description": "Read."}, "defer_loading": True},
    ]
    assert json.dumps(engine_tools(tools)) == json.dumps(
        [
            {
                "type": "function",
                "function": {"name": "run", "description": None, "parameters": {"type": "object"}},
            },
            {
                "type": "function",
                "function": {
                    "name": "read",
                    "description": "Read.",
                    "parameters": None,
                    "strict": True,
                    "defer_loading": True,
                },
                "defer_loading": True,
            },
        ]
    )


@pytest.mark.parametrize(
    "tool",
    [
        {"type": "web_search"},
        {"function": {"description": "no name"}},
        {"function": {"name": "f", "parameters": "{}"}},
        {"function": {"name": "f", "strict": "yes"}},
    ],
)
def test_tools_vllm_would_refuse_are_no_prompt_here(tool: Any) -> None:
    with pytest.raises(InvalidPrompt):
        engine_tools([tool])


def test_messages_for_other_endpoints_carry_reasoning_content_as_reasoning() -> None:
    messages = [
        {"role": "assistant", "content": "", "reasoning_content": "r"},
        {"role": "user", "content": "x"},
    ]
    assert engine_messages(messages) == [{"role": "assistant", "content": "", "reasoning": "r"}, messages[1]]
    kept = {"role": "assistant", "content": "", "reasoning": "mine", "reasoning_content": "r"}
    assert engine_messages([kept]) == [{"role": "assistant", "content": "", "reasoning": "mine"}]
