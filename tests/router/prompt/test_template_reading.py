"""What the router reads from a chat template: the content format and the variables it takes."""

from __future__ import annotations

from typing import Any

import pytest

from router.prompt.chat_conversation import InvalidPrompt, engine_conversation, engine_template_kwargs
from router.prompt.template_reading import content_format, template_variables
from tests.support.chat_templates import PARTS_LOOP, TEMPLATES


@pytest.mark.parametrize("name", TEMPLATES)
def test_content_format_is_found_from_the_templates_loops(name: str) -> None:
    template, expected = TEMPLATES[name]
    assert content_format(template) == expected


def test_a_template_that_does_not_parse_reads_strings() -> None:
    assert content_format("{% for message in messages %}{{ message.content }") == "string"


def test_template_variables_are_those_read_but_never_set() -> None:
    template = "{% set x = 1 %}{% for m in messages %}{{ m.content }}{% endfor %}{{ x }}{{ enable_thinking }}"
    assert template_variables(template) == {"messages", "enable_thinking"}


def test_as_parts_every_content_becomes_a_list_of_text_parts() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": ""},
                "b",
            ],
        },
        {"role": "assistant", "content": None},
        {
            "role": "tool",
            "tool_call_id": "c1",
            "content": [{"type": "text", "text": "x"}, {"type": "text", "text": ""}, "y"],
        },
    ]
    conversation = engine_conversation(messages, PARTS_LOOP)
    assert [message["content"] for message in conversation] == [
        [{"type": "text", "text": "be brief"}],
        [
            {"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},  # unknown fields stay
            {"type": "text", "text": ""},
            {"type": "text", "text": "b"},
        ],
        [],
        "x\n\ny",  # a tool result is joined back into one string, empty parts included
    ]
    as_string = engine_conversation(messages, TEMPLATES["prints content"][0])
    assert [message["content"] for message in as_string] == ["be brief", "a\nb", "", "x\ny"]


def test_as_parts_the_billing_header_line_goes_and_with_it_a_part_left_empty() -> None:
    header = "x-anthropic-billing-header: cch=1;"
    messages = [{"role": "system", "content": [header, {"type": "text", "text": header + "\nkeep"}]}]
    assert engine_conversation(messages, PARTS_LOOP)[0]["content"] == [{"type": "text", "text": "keep"}]


def test_developer_messages_merge_into_one_system_message_as_text() -> None:
    messages = [
        {"role": "system", "content": "one"},
        {
            "role": "developer",
            "content": [{"type": "text", "text": "two"}, {"type": "text", "text": "three"}],
        },
        {"role": "user", "content": "go"},
    ]
    conversation = engine_conversation(messages, PARTS_LOOP)
    assert conversation[0] == {"role": "system", "content": "one\n\ntwo\nthree"}
    assert conversation[1]["content"] == [{"type": "text", "text": "go"}]


def test_chat_template_kwargs_keep_what_the_template_reads() -> None:
    template = "{{ messages[0].content }}{% if enable_thinking %}<think>{% endif %}"
    kwargs = {"enable_thinking": True, "unread": 1}
    assert engine_template_kwargs(kwargs, template) == {"enable_thinking": True}


@pytest.mark.parametrize(
    "key", ["tools", "documents", "add_generation_prompt", "truncation", "chat_template"]
)
def test_chat_template_kwargs_that_set_apply_chat_templates_own_parameters_are_not_rendered_here(
    key: str,
) -> None:
    with pytest.raises(InvalidPrompt, match=key):
        engine_template_kwargs({key: None}, "{{ messages }}")
