"""The simulated fleet keys a chat's images as vLLM 0.32 does: its block hashes for the captured chat equal
the real engine's (tests/fixtures/vllm/multimodal_capture.json), and, serving the tiny Idefics3, the router in
front predicts exactly the blocks it finds for a chat of images sent again and after an image changes."""

from __future__ import annotations

import base64
import io
import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from fleet.block_pool import BlockHasher, BlockPool
from kvroute.processes import FleetPorts, running_fleet, running_router_process
from router.dispatch.observe.routing_headers import CACHED_BLOCKS_HEADER
from router.prompt.multimodal.block_keys import Placed
from tests.support.http import post
from tests.support.waiting import eventually
from tinymodel.vision import VISION_MODEL_NAME, build_files

CAPTURE = Path(__file__).parents[1] / "fixtures" / "vllm" / "multimodal_capture.json"
BLOCK = 32


def test_the_fleets_block_hashes_of_a_chat_with_images_are_the_engines() -> None:
    capture = json.loads(CAPTURE.read_text())
    items = [
        Placed(identifier, where["offset"], where["length"])
        for identifier, where in zip(capture["mm_hashes"], capture["placeholders"], strict=True)
    ]
    hashes = BlockHasher(seed="0").chain(capture["token_ids"], BLOCK, items=items)  # PYTHONHASHSEED=0
    event, pool = capture["events"][0], BlockPool(16, BLOCK)
    assert [pool.wire_hash(h) for h in hashes[: len(event["block_hashes"])]] == event["block_hashes"]


@pytest.fixture(scope="module")
def vision_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Two simulated instances serving the tiny Idefics3, and a router that finds its tokenizer by their root."""
    model = tmp_path_factory.mktemp("model") / VISION_MODEL_NAME
    build_files(model)
    ports, logs = FleetPorts.allocate(2), tmp_path_factory.mktemp("logs")
    args = ["--model", VISION_MODEL_NAME, "--tokenizer", str(model), "--enable-prompt-tokens-details"]
    config = ports.router_config(models=[{"name": VISION_MODEL_NAME}])
    with running_fleet(ports, logs, args), running_router_process(config, logs, "router") as (url, _):
        yield url


def image(seed: int, size: tuple[int, int]) -> str:
    rng = random.Random(seed)
    png = io.BytesIO()
    Image.frombytes("RGB", size, bytes(rng.randrange(256) for _ in range(size[0] * size[1] * 3))).save(
        png, "PNG"
    )
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


def chat(url: str, images: list[str], session: str) -> tuple[int, int]:
    """The router's predicted cached blocks, and the instance's cached tokens in blocks."""
    content: list[dict[str, Any]] = [
        {"type": "text", "text": "Compare these screenshots of the failing test. " * 3}
    ]
    content += [{"type": "image_url", "image_url": {"url": url}} for url in images]
    body = {"model": VISION_MODEL_NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 1}
    return predicted_and_found(url + "/v1/chat/completions", body, session, _chat_cached)


def predicted_and_found(
    url: str, body: dict[str, Any], session: str, cached: Callable[[dict[str, Any]], int]
) -> tuple[int, int]:
    """The router's predicted cached blocks, and the instance's cached tokens (cached: read from the answer's
    usage) in blocks."""
    status, headers, answer = post(url, json.dumps(body).encode(), {"x-session-id": session})
    assert status == 200, answer
    return int(headers[CACHED_BLOCKS_HEADER]), cached(json.loads(answer)["usage"]) // BLOCK


def _chat_cached(usage: dict[str, Any]) -> int:
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def test_a_chat_of_images_sent_again_and_changed_is_predicted_as_the_instance_finds_it(
    vision_router: str,
) -> None:
    first, second, other = image(1, (60, 45)), image(2, (90, 70)), image(3, (90, 70))
    assert chat(vision_router, [first, second], "a") == (0, 0)
    again: list[tuple[int, int]] = []
    eventually(
        lambda: again.append(chat(vision_router, [first, second], "a")) or again[-1][0] > 0, what="indexed"
    )
    predicted, found = again[-1]
    assert predicted == found > 0
    changed, found_changed = chat(vision_router, [first, other], "a")
    assert 0 < changed == found_changed < found


def predicted_as_found(send: Callable[[], tuple[int, int]]) -> None:
    """send() first finds nothing; sent again once the router indexed it, it is predicted as found."""
    assert send() == (0, 0)
    again: list[tuple[int, int]] = []
    eventually(lambda: again.append(send()) or again[-1][0] > 0, what="indexed")
    predicted, found = again[-1]
    assert predicted == found > 0


def test_a_messages_image_is_keyed_as_the_chat_vllm_converts_it_to(vision_router: str) -> None:
    """Claude Code's image blocks (base64) through /v1/messages: vLLM converts them to chat image parts, and
    the router keys them alike."""
    png = image(4, (120, 80)).partition(",")[2]
    blocks = [
        {"type": "text", "text": "Why does this screenshot of the failing test show a timeout? " * 3},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}},
    ]
    body = {"model": VISION_MODEL_NAME, "max_tokens": 1, "messages": [{"role": "user", "content": blocks}]}

    url = vision_router + "/v1/messages"
    predicted_as_found(
        lambda: predicted_and_found(url, body, "m", lambda usage: usage["cache_read_input_tokens"])
    )


def test_a_chat_with_tools_and_an_image_is_keyed_too(vision_router: str) -> None:
    """An agent's chat carries tools: rendered here with them (an instance's /tokenize would give its ids
    without its images' keys)."""
    tool = {
        "type": "function",
        "function": {"name": "read", "parameters": {"type": "object", "properties": {}}},
    }
    content = [
        {"type": "text", "text": "Read the log this screenshot points at. " * 3},
        {"type": "image_url", "image_url": {"url": image(5, (100, 100))}},
    ]
    body = {
        "model": VISION_MODEL_NAME,
        "messages": [{"role": "user", "content": content}],
        "tools": [tool],
        "tool_choice": "none",
        "max_tokens": 1,
    }

    url = vision_router + "/v1/chat/completions"
    predicted_as_found(lambda: predicted_and_found(url, body, "t", _chat_cached))


def test_a_responses_input_image_is_keyed_as_vllms_chat_parser_reads_it(vision_router: str) -> None:
    """Codex's input_image parts through /v1/responses."""
    content = [
        {"type": "input_text", "text": "What does this screenshot of the build say? " * 3},
        {"type": "input_image", "image_url": image(6, (64, 150)), "detail": "auto"},
    ]
    body = {
        "model": VISION_MODEL_NAME,
        "input": [{"role": "user", "content": content}],
        "max_output_tokens": 1,
        "store": False,
    }

    url = vision_router + "/v1/responses"
    predicted_as_found(
        lambda: predicted_and_found(
            url, body, "r", lambda usage: usage["input_tokens_details"]["cached_tokens"]
        )
    )
