"""A chat's images, as the router meets them while it lays out the conversation for the template.

vLLM hands a template that reads content as a string each message's images as the model's placeholder, one a
line before the message's text (``renderers/chat_utils.py``, ``_get_full_multimodal_text_prompt``, without
``--interleave-mm-strings``). The conversation's builder (router/prompt/chat_conversation.py) does the same
when it is given a ChatImages, and keeps each image's part here, in order; without one, a chat with images is
not laid out (it is routed by load).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ChatImages:
    placeholder: str  # the model's text for one image (Idefics3: "<image>")
    parts: list[Mapping[str, Any]] = field(default_factory=list)  # the image parts met, in order

    def content(self, images: int, text: str) -> str:
        """A message's content: its images' placeholders, one a line, then its text."""
        return "\n".join([self.placeholder] * images + ([text] if text else []))


def is_image_part(part: Any) -> bool:
    """An OpenAI chat ``image_url`` part (its url a string, or an object holding one), or a Responses
    ``input_image`` part (its ``image_url`` a string), which vLLM's chat parser reads alike."""
    if not isinstance(part, Mapping) or part.get("type") not in ("image_url", "input_image"):
        return False
    url = part.get("image_url")
    return isinstance(url, str) or (isinstance(url, Mapping) and isinstance(url.get("url"), str))


def image_parts(messages: Any) -> Iterator[Mapping[str, Any]]:
    """The image parts of the chat's messages, in order."""
    if not isinstance(messages, list):
        return
    for message in messages:
        if isinstance(message, Mapping) and isinstance(content := message.get("content"), list):
            yield from (part for part in content if is_image_part(part))


def has_image_parts(messages: Any) -> bool:
    """Whether any of the chat's messages carries an image part."""
    return next(image_parts(messages), None) is not None


def image_url(part: Mapping[str, Any]) -> str:
    url = part["image_url"]
    return url if isinstance(url, str) else str(url["url"])
