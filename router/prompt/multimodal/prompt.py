"""A chat with images, tokenized as vLLM will see it: the conversation rendered with each image's
placeholder, its token ids with each placeholder replaced by the image's tokens, and each image placed
(its identifier and its tokens' range) for its blocks' keys (router/prompt/multimodal/block_keys.py).

An image sent inline (a ``data:`` URL) is read from its bytes; its identifier is the client's ``uuid`` when
the part has one, else its hash (router/prompt/multimodal/item_hash.py). An image given by another URL is not
fetched here: the request is routed by load.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from router.prompt.chat_conversation import InvalidPrompt
from router.prompt.multimodal.block_keys import Placed
from router.prompt.multimodal.chat_images import ChatImages, image_parts, image_url
from router.prompt.multimodal.item_hash import SentImage, UnreadableImage, image_hash
from router.prompt.multimodal.layouts import Idefics3Layout, laid_out
from router.prompt.template_inputs import TemplateInputs


class ImageChatTokenizer(Protocol):
    def render_chat(
        self,
        messages: Sequence[Any],
        add_generation_prompt: bool,
        continue_final_message: bool,
        inputs: TemplateInputs,
        images: ChatImages | None,
    ) -> str: ...

    def text_ids(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    @property
    def image_layout(self) -> Idefics3Layout | None: ...


def remote_image_urls(messages: Any) -> list[str]:
    """The URLs of the chat's images that are not inline: fetched before it is rendered (fetch.py)."""
    return [url for part in image_parts(messages) if not (url := image_url(part)).startswith("data:")]


def sent_image(part: Mapping[str, Any], fetched: Mapping[str, bytes]) -> SentImage:
    """The image of a part: sent inline as a ``data:`` URL, or fetched; InvalidPrompt for any other."""
    url = image_url(part)
    if url in fetched:
        try:
            return SentImage(fetched[url])
        except UnreadableImage as error:
            raise InvalidPrompt(f"a fetched image does not read: {error}") from None
    if not url.startswith("data:"):
        raise InvalidPrompt("an image given by URL is not fetched by the router")
    header, _, payload = url[5:].partition(",")
    if not header.endswith(";base64"):
        raise InvalidPrompt("an inline image must be base64")
    try:
        return SentImage(base64.b64decode(payload, validate=True))
    except (binascii.Error, ValueError, UnreadableImage) as error:
        raise InvalidPrompt(f"an inline image does not read: {error}") from None


def chat_with_images(
    tokenizer: ImageChatTokenizer,
    model_id: str,
    messages: Sequence[Any],
    flags: tuple[bool, bool, bool],
    inputs: TemplateInputs,
    fetched: Mapping[str, bytes] | None = None,
) -> tuple[list[int], list[Placed]]:
    """The chat's token ids with its images' tokens, and its images placed in them. flags:
    add_generation_prompt, continue_final_message, add_special_tokens; fetched: the bytes of the images given
    by URL, by URL."""
    add_generation_prompt, continue_final_message, add_special_tokens = flags
    layout = tokenizer.image_layout
    if layout is None:
        raise InvalidPrompt("the model's images are not laid out here")
    images = ChatImages(layout.placeholder)
    text = tokenizer.render_chat(messages, add_generation_prompt, continue_final_message, inputs, images)
    sent = [sent_image(part, fetched or {}) for part in images.parts]
    ids, ranges = laid_out(tokenizer.text_ids(text, add_special_tokens), layout, [s.size for s in sent])
    placed = []
    for part, image, (offset, length) in zip(images.parts, sent, ranges, strict=True):
        uuid = part.get("uuid")
        identifier = uuid if isinstance(uuid, str) and uuid else image_hash(model_id, image)
        placed.append(Placed(identifier, offset, length))
    return ids, placed
