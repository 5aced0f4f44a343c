"""The router's token ids are vLLM's own: chat and completion prompts against each instance's /tokenize."""

from __future__ import annotations

from typing import Any

import pytest

from kvroute.stack.run import Stack
from router.apis.openai_body import ChatRequest
from router.prompt.template_inputs import TemplateInputs
from router.prompt.tokenization import PromptTokenizer
from tests.stack.client import BLOCK, CACHED_HEADER, INSTANCE_HEADER, MODEL, metric, post, wait_steady
from tests.support.waiting import eventually

pytestmark = pytest.mark.stack

SYSTEM = {"role": "system", "content": "You are a careful coding agent. Answer with a plan, then a diff."}
CHATS: list[tuple[str, list[dict[str, Any]]]] = [
    ("one user turn", [{"role": "user", "content": "Fix the failing test in client/http.py"}]),
    ("system prompt", [SYSTEM, {"role": "user", "content": "Run the tests."}]),
    (
        "multi-turn",
        [
            SYSTEM,
            {"role": "user", "content": "Read router/proxy.py"},
            {
                "role": "assistant",
                "content": "It forwards the body byte for byte; retries before the first byte.",
            },
            {"role": "tool", "content": '{"exit_code": 0, "passed": 128, "skipped": 3}'},
            {"role": "user", "content": "Now make the retry budget configurable."},
        ],
    ),
    ("unicode", [{"role": "user", "content": "Übersetze: «naïve café» — 東京の天気は? 🙂 ∑x² ≤ π"}]),
    (
        "whitespace and specials",
        [{"role": "user", "content": "  tabs\tand\nnewlines\r\n <s> </s> <|user|> "}],
    ),
    ("empty content", [SYSTEM, {"role": "user", "content": ""}]),
    (
        "text parts",
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "two"}],
            }
        ],
    ),
]
PROMPTS: list[tuple[str, str]] = [
    (
        "code",
        "def backoff(base: float, attempts: int) -> list[float]:\n    return [base * 2**i for i in range(attempts)]\n",
    ),
    ("unicode", "naïve café — 東京 🙂 ∑x² ≤ π"),
    ("special token text", "<s>hello</s> <pad>"),
    ("leading spaces", "   indented\n\n\ttab"),
    ("long", " ".join(f"word{i}" for i in range(600))),
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize(("name", "messages"), CHATS, ids=[name for name, _ in CHATS])
def test_chat_ids_equal_vllm(
    stack: Stack,
    tokenizer: PromptTokenizer,
    name: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
) -> None:
    body = {"model": MODEL, "messages": messages, "add_generation_prompt": add_generation_prompt}
    for instance in stack.instances:
        vllm_ids = post(instance.url + "/tokenize", body).body["tokens"]
        assert tokenizer.chat_ids(messages, add_generation_prompt=add_generation_prompt) == vllm_ids, (
            instance.name
        )


@pytest.mark.parametrize(("name", "prompt"), PROMPTS, ids=[name for name, _ in PROMPTS])
def test_completion_ids_equal_vllm(stack: Stack, tokenizer: PromptTokenizer, name: str, prompt: str) -> None:
    for instance in stack.instances:
        vllm_ids = post(instance.url + "/tokenize", {"model": MODEL, "prompt": prompt}).body["tokens"]
        assert tokenizer.completion_ids(prompt) == vllm_ids, instance.name


READ = {
    "name": "read_file",
    "description": "Read a file of the repository.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
}
RUN = {"name": "run", "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}
TOOLS = [{"type": "function", "function": READ}, {"type": "function", "function": RUN}]


def call(call_id: str, name: str, arguments: str, **extra: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}, **extra}


AGENT_TURNS: list[dict[str, Any]] = [
    {
        "role": "system",
        "content": "x-anthropic-billing-header: cc_version=2.1; cch=81f3e\nYou are a coding agent.",
    },
    {"role": "user", "content": "Why does the retry test fail?", "name": "dev"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [call("c1", "read_file", '{"path": "router/proxy.py", "note": "naïve 東京"}')],
    },
    {
        "role": "tool",
        "tool_call_id": "c1",
        "content": [
            {"type": "text", "text": "def retry():"},
            {"type": "text", "text": ""},
            {"type": "text", "text": "    pass"},
        ],
    },
    {
        "role": "assistant",
        "content": "The body is empty.",
        "reasoning": "Read it first.",
        "tool_calls": [call("c2", "run", '{"cmd": "pytest -x"}', index=0)],
    },
    {"role": "tool", "tool_call_id": "c2", "content": "1 failed"},
]
ODD_CALLS = [
    {"role": "user", "content": "go"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [call("a", "run", "{not json"), call("b", "run", "[1, 2]"), call("c", "run", "")],
    },
    {"role": "assistant", "content": "no calls", "tool_calls": []},
]
FLAGGED_TOOL = {
    "type": "function",
    "defer_loading": True,
    "x": 1,
    "function": {**RUN, "strict": True, "description": "Run a shell command.", "y": 2},
}
DEVELOPER = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hi"},
    {"role": "developer", "content": "Use the tools.", "tools": None},
]
# vLLM answers "auto" (the default) only when started with a tool-call parser; "none" still renders the tools.
ONE_TOKEN = {"tool_choice": "none", "max_tokens": 1, "return_token_ids": True}
TOOL_CHATS: list[tuple[str, list[dict[str, Any]], list[dict[str, Any]]]] = [
    ("tools, one user turn", [{"role": "user", "content": "List the files."}], TOOLS),
    ("agent turns", AGENT_TURNS, TOOLS),
    ("arguments that are no object", ODD_CALLS, TOOLS),
    ("tool flags and extra fields", [{"role": "user", "content": "hi"}], [FLAGGED_TOOL]),
    ("developer messages", DEVELOPER, TOOLS),
]


@pytest.mark.parametrize(("name", "messages", "tools"), TOOL_CHATS, ids=[name for name, _, _ in TOOL_CHATS])
def test_chats_with_tools_equal_vllm(
    stack: Stack, tokenizer: PromptTokenizer, name: str, messages: list[dict[str, Any]], tools: list[Any]
) -> None:
    """What the router renders itself equals both what /tokenize answers and the prompt the chat endpoint
    runs (return_token_ids), on each instance."""
    ids = tokenizer.chat_ids(messages, inputs=TemplateInputs(tools=tools))
    assert "<|tools|>" in tokenizer.render_chat(messages, inputs=TemplateInputs(tools=tools))
    for instance in stack.instances:
        body = {"model": MODEL, "messages": messages, "tools": tools}
        assert post(instance.url + "/tokenize", body).body["tokens"] == ids, instance.name
        ran = post(instance.url + "/v1/chat/completions", {**body, **ONE_TOKEN})
        assert ran.body["prompt_token_ids"] == ids, instance.name


def test_deprecated_reasoning_content_renders_as_the_chat_endpoint_does(
    stack: Stack, tokenizer: PromptTokenizer
) -> None:
    """The chat endpoint renames reasoning_content to reasoning (its /tokenize does not)."""
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ok", "reasoning_content": "think"},
        {"role": "user", "content": "more"},
    ]
    ids = tokenizer.chat_ids(messages, inputs=TemplateInputs(tools=TOOLS))
    assert ids != tokenizer.chat_ids(
        [{**m, "reasoning_content": None} for m in messages], inputs=TemplateInputs(tools=TOOLS)
    )
    body = {"model": MODEL, "messages": messages, "tools": TOOLS, **ONE_TOKEN}
    assert post(stack.instances[0].url + "/v1/chat/completions", body).body["prompt_token_ids"] == ids


@pytest.mark.parametrize(
    "template_kwargs",
    [{"enable_thinking": False}, {"enable_thinking": True}, {"unread": 1, "enable_thinking": 0}],
)
def test_chat_template_kwargs_equal_vllm(
    stack: Stack, tokenizer: PromptTokenizer, template_kwargs: dict[str, Any]
) -> None:
    messages = [SYSTEM, {"role": "user", "content": "Plan first."}]
    ids = tokenizer.chat_ids(messages, inputs=TemplateInputs(template_kwargs=template_kwargs))
    body = {"model": MODEL, "messages": messages, "chat_template_kwargs": template_kwargs}
    for instance in stack.instances:
        assert post(instance.url + "/tokenize", body).body["tokens"] == ids, instance.name


@pytest.mark.parametrize("effort", ["none", "high"])
def test_reasoning_effort_renders_as_the_chat_endpoint_does(
    stack: Stack, tokenizer: PromptTokenizer, effort: str
) -> None:
    """The chat endpoint passes reasoning_effort to the template, and enable_thinking with it."""
    messages = [SYSTEM, {"role": "user", "content": "Plan first."}]
    kwargs = ChatRequest(model=MODEL, messages=messages, reasoning_effort=effort).template_kwargs()
    body = {"model": MODEL, "messages": messages, "reasoning_effort": effort, **ONE_TOKEN}
    reply = post(stack.instances[0].url + "/v1/chat/completions", body)
    assert reply.body["prompt_token_ids"] == tokenizer.chat_ids(
        messages, inputs=TemplateInputs(template_kwargs=kwargs)
    )


def test_router_routes_chats_with_tools_by_their_prefix_and_its_audit_agrees(stack: Stack) -> None:
    """Through the router: the second turn of an agent session with tools and chat_template_kwargs is
    credited with its first turn's blocks (the router rendered both itself; in that instance's cache or,
    through it, in the pool), and the audit's check against an instance's /tokenize matched."""
    router = stack.router_url
    messages = [*AGENT_TURNS, {"role": "user", "content": "Fix it, then run the whole suite again. " * 8}]
    body = {
        "model": MODEL,
        "messages": messages,
        "tools": TOOLS,
        "chat_template_kwargs": {"enable_thinking": False},
        **ONE_TOKEN,
    }
    first = post(router + "/v1/chat/completions", body)
    name = first.headers[INSTANCE_HEADER]
    wait_steady(lambda: metric(router, "kvroute_index_blocks", vllm_instance=name))
    messages += [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "Commit it."}]

    second = post(router + "/v1/chat/completions", {**body, "messages": messages})

    assert int(second.headers[CACHED_HEADER]) >= len(first.body["prompt_token_ids"]) // BLOCK > 0
    audits = "kvroute_tokenization_audits_total"
    compared = ("match", "mismatch")
    eventually(
        lambda: sum(metric(router, audits, kind="with_inputs", result=r) for r in compared), what="an audit"
    )
    assert metric(router, audits, result="mismatch") == 0
    assert metric(router, audits, kind="with_inputs", result="match") >= 1
