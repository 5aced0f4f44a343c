"""Engines run with vLLM's --exclude-tools-when-tool-choice-none render a chat whose tool_choice is "none"
without its tools; a router told so (the model's exclude_tools_when_tool_choice_none) counts the same prompt
blocks as the engine, against a simulated fleet run with that option."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvroute.processes import FleetPorts, running_fleet, running_router
from router.prompt.template_inputs import TemplateInputs
from router.prompt.tokenization import PromptTokenizer
from tests.support.http import post

BLOCK = 16
MESSAGES = [{"role": "user", "content": "Summarise the failing tests in two lines. " * 6}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Runs the project's test suite.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    },
]


@pytest.fixture(scope="module")
def fleet(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetPorts]:
    ports = FleetPorts.allocate(1)
    args = ["--block-size", str(BLOCK), "--prefill-tps", "200000", "--exclude-tools-when-tool-choice-none"]
    with running_fleet(ports, tmp_path_factory.mktemp("fleet"), args):
        yield ports


def _prompt_blocks(router_url: str, tool_choice: str) -> tuple[int, int]:
    """The router's count of the chat's prompt blocks and the engine's, from its usage."""
    body = {
        "model": "tiny-llama",
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "max_tokens": 1,
    }
    status, headers, answer = post(router_url + "/v1/chat/completions", json.dumps(body).encode())
    assert status == 200, answer
    return int(headers["x-kvroute-prompt-blocks"]), json.loads(answer)["usage"]["prompt_tokens"] // BLOCK


@pytest.mark.parametrize("told", [True, False], ids=["router told", "router not told"])
def test_the_router_counts_the_engines_prompt_when_told_of_the_option(
    fleet: FleetPorts, tokenizer: PromptTokenizer, tmp_path: Path, told: bool
) -> None:
    with_tools, without = (
        len(tokenizer.chat_ids(MESSAGES, inputs=TemplateInputs(tools=t))) // BLOCK for t in (TOOLS, None)
    )
    assert with_tools > without  # the tools take blocks of their own
    config = fleet.router_config(block_size=BLOCK)
    config["models"] = [{"name": "tiny-llama", "exclude_tools_when_tool_choice_none": told}]
    with running_router(config, tmp_path) as url:
        router_blocks, engine_blocks = _prompt_blocks(url, "none")
        assert engine_blocks == without  # the engine left the tools out
        assert (router_blocks == engine_blocks) is told
        assert _prompt_blocks(url, "auto") == (with_tools, with_tools)  # other choices keep them
