"""anthropic_chat_body against real vLLM 0.32: each captured Messages body, converted and rendered here as the
router renders a chat, gives the ids vLLM rendered (tests/fixtures/vllm/messages_render_capture.json, from
scripts/capture_messages_renders.py: two servers, the tiny model's own template and one that takes inline
system messages and reads reasoning_effort)."""

from __future__ import annotations

import copy
import json
import random
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
import pytest

from router.apis.messages.chat import TemplateProbes, anthropic_chat_body, template_probes
from router.apis.openai_body import ChatRequest
from router.prompt.chat_conversation import InvalidPrompt
from router.prompt.template_inputs import TemplateInputs
from router.prompt.tokenization import PromptTokenizer

CAPTURE = json.loads(
    (Path(__file__).parents[3] / "fixtures" / "vllm" / "messages_render_capture.json").read_text()
)
CASES = {f"{case['server']}/{case['name']}": case for case in CAPTURE["cases"]}
MAIN = TemplateProbes(merge_inline_system=True, disabled_thinking_effort="none")
HELLO = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizers(tokenizer: PromptTokenizer, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tokenizer each captured server rendered with: the model's, and the model's with the inline one's
    template."""
    inline = tmp_path_factory.mktemp("inline-template")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, inline / name)
    config = json.loads((inline / "tokenizer_config.json").read_text())
    config["chat_template"] = CAPTURE["servers"]["inline"]["chat_template"]
    (inline / "tokenizer_config.json").write_text(json.dumps(config))
    return {"main": tokenizer, "inline": PromptTokenizer(inline)}


def router_ids(tokenizer: PromptTokenizer, body: dict[str, Any], probes: TemplateProbes) -> list[int]:
    """As the router tokenizes the converted body: decoded into its ChatRequest, rendered as a chat."""
    chat = msgspec.convert(anthropic_chat_body(body, probes), ChatRequest, strict=False)
    return tokenizer.chat_ids(
        chat.messages,
        chat.add_generation_prompt,
        chat.continue_final_message,
        chat.add_special_tokens,
        TemplateInputs(chat.tools, chat.template_kwargs()),
    )


def test_the_probes_decide_as_the_servers_did(tokenizers: dict[str, PromptTokenizer]) -> None:
    # main logged "requires system-first ordering" (its template needs eos_token, which the probe leaves out)
    assert template_probes(tokenizers["main"]) == MAIN
    assert template_probes(tokenizers["inline"]) == TemplateProbes(False, "low")


@pytest.mark.parametrize("key", sorted(CASES))
def test_the_body_renders_the_ids_vllm_rendered(key: str, tokenizers: dict[str, PromptTokenizer]) -> None:
    case = CASES[key]
    tokenizer = tokenizers[case["server"]]
    probes = template_probes(tokenizer)
    ids = router_ids(tokenizer, case["body"], probes)
    # /v1/messages/render never probes the effort of disabled thinking: it always takes "none"
    rendered = router_ids(tokenizer, case["body"], replace(probes, disabled_thinking_effort="none"))
    assert case["render"]["status"] == 200
    assert rendered == case["render"]["token_ids"]
    # count_tokens and /v1/messages do probe it: their prompt is the probed one
    assert case["count_tokens"]["answer"]["input_tokens"] == len(ids)
    if case["messages"]["status"] == 200:
        assert case["messages"]["input_tokens"] == len(ids)


def test_disabled_thinking_takes_the_probed_effort_where_none_is_ignored(
    tokenizers: dict[str, PromptTokenizer],
) -> None:
    case = CASES["inline/thinking_disabled"]
    assert len(case["render"]["token_ids"]) == 40  # "<effort>max": the template reads "none" as "max"
    assert case["count_tokens"]["answer"]["input_tokens"] == 39  # "<effort>low"
    assert (
        anthropic_chat_body(case["body"], template_probes(tokenizers["inline"]))["reasoning_effort"] == "low"
    )
    over_effort = anthropic_chat_body(CASES["main/thinking_disabled_over_effort"]["body"], MAIN)
    assert over_effort["reasoning_effort"] == "none"


def test_inline_system_messages_are_merged_or_kept_as_the_template_needs() -> None:
    body = {
        "messages": [
            *HELLO,
            {"role": "system", "content": "Now be brief."},
            {"role": "user", "content": "again"},
        ],
        "system": [{"type": "text", "text": "Top. "}],
    }
    merged = anthropic_chat_body(body, MAIN)["messages"]
    assert merged == [{"role": "system", "content": "Top. Now be brief."}, *HELLO, body["messages"][2]]
    kept = anthropic_chat_body(body, TemplateProbes(False, "none"))["messages"]
    assert kept == [{"role": "system", "content": "Top. "}, *body["messages"]]


def test_the_claude_code_body_keeps_what_routing_reads() -> None:
    body = CASES["main/claude_code_second_turn"]["body"]
    untouched = copy.deepcopy(body)
    chat = anthropic_chat_body(body, MAIN)
    assert body == untouched
    assert (chat["model"], chat["stream"], chat["tool_choice"], chat["reasoning_effort"]) == (
        "tiny",
        True,
        "auto",
        "high",
    )
    assert chat["messages"][0]["content"].startswith("You are Claude Code")  # the billing header dropped
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool", "user"]
    assert chat["messages"][2]["reasoning"] == "List the files."
    assert (
        chat["messages"][2]["tool_calls"][0]["function"]["arguments"] == '{"command": "ls", "timeout": 1000}'
    )
    assert len(chat["tools"]) == 25
    assert "metadata" not in chat and "thinking" not in chat and "output_config" not in chat


def test_a_schema_without_a_type_gets_object_last_and_the_body_is_not_changed() -> None:
    schema = {"properties": {"a": {"type": "string"}}}
    body = {"messages": HELLO, "tools": [{"name": "t", "input_schema": schema, "strict": "true"}]}
    (tool,) = anthropic_chat_body(body)["tools"]
    assert list(tool["function"]["parameters"]) == ["properties", "type"]
    parameters = schema | {"type": "object"}
    assert tool["function"] == {"name": "t", "description": None, "parameters": parameters, "strict": True}
    assert schema == {"properties": {"a": {"type": "string"}}}


def test_an_image_block_becomes_the_chat_image_part_vllm_makes_of_it() -> None:
    """By URL as given, inline as a data URL of its media type: the chat path keys it (or routes it by load)."""
    inline = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}
    content = [{"type": "text", "text": "look"}, {"type": "image", "source": inline}]
    content.append({"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}})
    (message,) = anthropic_chat_body({"messages": [{"role": "user", "content": content}]})["messages"]
    assert message["content"] == [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
    ]


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ({"messages": "hi"}, "messages must be a list"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "role user, assistant or system"),
        ({"messages": [{"role": "user", "content": 5}]}, "content must be"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "unknown type"),
        ({"messages": [{"role": "user", "content": ["hi"]}]}, "unknown type"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            "text has the wrong type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": "u"}]}]},
            "source has the wrong type",
        ),
        (
            {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "t"}]}]},
            "without an id",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "tool_result", "content": [{"type": "image"}]}]}
                ]
            },
            "images or tool references",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "content": [{"type": "text", "text": None}]}],
                    }
                ]
            },
            "without a string text",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": ["x"]}]}]}, "objects"),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "is_error": "maybe"}]}]},
            "is_error",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_removal", "tool": {}}]}]},
            "only in system messages",
        ),
        ({"messages": HELLO, "system": 5}, "system must be"),
        ({"messages": HELLO, "system": [{"type": "tool_addition", "tool": {}}]}, "only in system messages"),
        ({"messages": HELLO, "tools": {"name": "t"}}, "tools must be a list"),
        ({"messages": HELLO, "tools": [{"name": "t"}]}, "input_schema"),
        ({"messages": HELLO, "tools": [{"name": "t", "input_schema": {}, "strict": "maybe"}]}, "strict"),
        ({"messages": HELLO, "tool_choice": {"type": "tool"}}, "tool_choice"),
        ({"messages": HELLO, "tool_choice": "auto"}, "tool_choice"),
        ({"messages": HELLO, "output_config": {"effort": "extreme"}}, "effort"),
        ({"messages": HELLO, "output_config": "high"}, "output_config must be"),
        ({"messages": HELLO, "thinking": {"type": "sometimes"}}, "thinking.type"),
        ({"messages": HELLO, "chat_template_kwargs": []}, "chat_template_kwargs"),
        ({"messages": [{"role": "user", "content": []}]}, "nothing to render"),
        (
            {
                "messages": [
                    {
                        "role": "system",
                        "content": [
                            {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "x"}}
                        ],
                    },
                    *HELLO,
                ]
            },
            "not declared",
        ),
        (
            {
                "messages": [
                    {
                        "role": "system",
                        "content": [{"type": "tool_removal", "tool": {"type": "tool_definition"}}],
                    },
                    *HELLO,
                ]
            },
            "tool_reference",
        ),
    ],
)
def test_what_vllm_would_not_render_so_is_invalid(body: dict[str, Any], why: str) -> None:
    with pytest.raises(InvalidPrompt, match=why):
        anthropic_chat_body(body, MAIN)


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [*HELLO, {"role": "system", "content": "Now be brief."}]},
        {"messages": HELLO, "thinking": {"type": "disabled"}},
    ],
)
def test_what_depends_on_the_template_needs_its_probes(body: dict[str, Any]) -> None:
    with pytest.raises(InvalidPrompt, match="depends on the template"):
        anthropic_chat_body(body)
    anthropic_chat_body(body, MAIN)


def test_an_inline_system_message_without_text_needs_no_probes() -> None:
    billing_only = {"role": "system", "content": "x-anthropic-billing-header: cch=1;"}
    assert anthropic_chat_body({"messages": [*HELLO, billing_only]})["messages"] == HELLO


ODD_VALUES: list[Any] = [None, 0, 1.5, True, "", "x", [], [1], {}, {"type": "text"}, {"type": "x"}, [None]]


def _paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [path]
    children = (
        value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    )
    for key, child in children:
        found += _paths(child, (*path, key))
    return found


FUZZED = sorted(key for key in CASES if key.startswith("main/") and "claude_code" not in key)


@pytest.mark.parametrize("key", [*FUZZED, "main/claude_code_second_turn"])
def test_odd_json_anywhere_gives_a_chat_or_invalid_prompt_only(
    key: str, tokenizers: dict[str, PromptTokenizer]
) -> None:
    """Any value of a captured body replaced by any odd one: a chat the router renders, or InvalidPrompt (or
    the router's decoding refuses it). The Claude Code body: 100 of its places, at random."""
    base = CASES[key]["body"]
    paths = [path for path in _paths(base) if path]
    if len(paths) > 100:
        paths = random.Random(41).sample(paths, 100)
    for path in paths:
        for odd in ODD_VALUES:
            body = copy.deepcopy(base)
            holder = body
            for step in path[:-1]:
                holder = holder[step]
            holder[path[-1]] = odd
            try:
                router_ids(tokenizers["main"], body, MAIN)
            except (InvalidPrompt, msgspec.ValidationError):
                continue
