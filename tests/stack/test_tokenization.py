"""The router's token ids are vLLM's own: chat and completion prompts against each instance's /tokenize."""

from __future__ import annotations

from typing import Any

import pytest

from kvroute.stack import Stack
from router.tokenization import PromptTokenizer
from tests.stack.client import MODEL, post

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
