"""The Anthropic Messages API's requests as the router reads them: the chat vLLM renders for them
(router/apis/messages/chat.py), and the session Claude Code names in metadata.user_id."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from router.apis.messages.chat import TemplateProbes, anthropic_chat_body
from router.apis.openai_body import ChatRequest, json_object, served_model
from router.apis.read import AgentRead, convert
from router.errors import bad_request
from router.prompt.chat_conversation import InvalidPrompt


class _MessagesMetadata(msgspec.Struct):
    user_id: str | None = None


class _MessagesHead(msgspec.Struct):
    model: str | None = None
    stream: bool | None = None
    metadata: _MessagesMetadata | None = None


def read_messages(
    raw: bytes, only_model: str | None, probes: Callable[[str], TemplateProbes | None]
) -> AgentRead:
    """An Anthropic Messages request, as the chat vLLM serves it; probes: the model's template's."""
    fields = json_object(raw)
    head = convert(fields, _MessagesHead)
    if (missing := _textless_block(fields)) is not None:
        raise bad_request(f"{missing}: Field required", "invalid_field", missing)
    model = served_model(head.model, only_model)
    session = head.metadata.user_id if head.metadata is not None else None
    try:
        chat = msgspec.convert(anthropic_chat_body(fields, probes(model)), ChatRequest, strict=False)
    except (InvalidPrompt, msgspec.ValidationError):
        return AgentRead(ChatRequest(messages=[], model=model, stream=head.stream), session, tokenize=False)
    chat.model = model
    return AgentRead(chat, session)


def _textless_block(fields: dict[str, Any]) -> str | None:
    """Where a text block has no text (messages.0.content.1.text, system.0.text), which Anthropic's API
    refuses and vLLM's conversion would drop, leaving a prompt with nothing of the client's."""
    places: list[tuple[str, Any]] = [("system", fields.get("system"))]
    messages = fields.get("messages")
    if isinstance(messages, list):
        places += [
            (f"messages.{i}.content", m.get("content")) for i, m in enumerate(messages) if isinstance(m, dict)
        ]
    for where, blocks in places:
        for at, block in enumerate(blocks if isinstance(blocks, list) else ()):
            if isinstance(block, dict) and block.get("type") == "text" and block.get("text") is None:
                return f"{where}.{at}.text"
    return None
