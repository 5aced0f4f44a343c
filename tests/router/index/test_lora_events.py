"""LoRA adapters against what real vLLM 0.32 published (captured by scripts/capture_vllm_lora.py): one prompt
sent to the base model, to an adapter, to the adapter with a cache_salt, extended on the adapter, and to the
base with the salt. The router, given each captured request body, must find exactly the blocks vLLM
announced for that request, and nothing another request's cache holds."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from router.apis.openai_body import CompletionRequest
from router.dispatch.decide.decision import Decider, DeciderOptions
from router.index.block_index import BlockIndex
from router.metrics import RouterMetrics
from router.prompt.token_cache import CachedChatTokenizer
from router.prompt.tokenization import PromptTokenizer
from tests.support.captured_events import index_of_batches

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vllm"
CAPTURE: dict[str, Any] = json.loads((FIXTURES / "lora_capture.json").read_text())
FRAMES: list[list[bytes]] = msgspec.msgpack.decode((FIXTURES / "lora_events.msgpack").read_bytes())
BLOCK = CAPTURE["block_size"]
NAMES = [r["name"] for r in CAPTURE["requests"]]


def request(name: str) -> dict[str, Any]:
    return CAPTURE["requests"][NAMES.index(name)]


def index_of(*names: str) -> BlockIndex:
    """The index after the batches the named requests published."""
    return index_of_batches(FRAMES, {seq for name in names for seq in request(name)["seqs"]}, BLOCK)


def matched_blocks(index: BlockIndex, name: str, tokenizer: PromptTokenizer) -> int:
    """The blocks the router credits the instance with for the captured request's body."""
    entry = request(name)
    cached = CachedChatTokenizer(tokenizer)
    models = {CAPTURE["base_model"], CAPTURE["lora_name"]}
    router = Decider(
        index,
        dict.fromkeys(models, cached),
        BLOCK,
        RouterMetrics(),
        options=DeciderOptions(adapters=frozenset({CAPTURE["lora_name"]})),
    )
    body = CompletionRequest(
        model=entry["model"], prompt=entry["prompt_token_ids"], cache_salt=entry["cache_salt"]
    )
    prepared = asyncio.run(router.prepare(body, None))
    return sum(m.gpu for m in prepared.request.matches.values())


@pytest.mark.parametrize("name", ["base", "lora", "lora-salted", "base-salted"])
def test_each_request_finds_exactly_the_blocks_vllm_announced_for_it(
    name: str, tokenizer: PromptTokenizer
) -> None:
    assert matched_blocks(index_of(name), name, tokenizer) == len(request(name)["prompt_token_ids"]) // BLOCK


@pytest.mark.parametrize("name", ["lora", "lora-salted", "base-salted", "base"])
def test_a_request_finds_nothing_in_the_cache_of_another_adapter_or_salt(
    name: str, tokenizer: PromptTokenizer
) -> None:
    others = [n for n in ("base", "lora", "lora-salted", "base-salted") if n != name]
    assert matched_blocks(index_of(*others), name, tokenizer) == 0


def test_an_adapters_continuation_chains_onto_its_first_request(tokenizer: PromptTokenizer) -> None:
    blocks = len(request("lora-extended")["prompt_token_ids"]) // BLOCK
    assert matched_blocks(index_of("lora", "lora-extended"), "lora-extended", tokenizer) == blocks
    assert (
        matched_blocks(index_of("lora"), "lora-extended", tokenizer)
        == len(request("lora")["prompt_token_ids"]) // BLOCK
    )
