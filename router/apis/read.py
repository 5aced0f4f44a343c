"""What the conductor's receive stage takes of a body (router/dispatch/conductor.py): the prompt it routes on,
the session, the instance a stored response pins it to, and what each attempt sends; and the bodies read for
their model alone (count_tokens, the tokenizer and pooling routes)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from router.apis.openai_body import ChatRequest, CompletionRequest, json_object, served_model
from router.errors import bad_request
from router.upstreams.instances import Instance


class _ModelOnly(msgspec.Struct):
    model: str | None = None


@dataclass(slots=True)
class AgentRead:
    """What the receive stage takes of a body."""

    body: ChatRequest | CompletionRequest  # the prompt routed on (an empty one: routed by load)
    session: str | None = None
    tokenize: bool = True
    pinned: Instance | None = None  # the instance that must serve it
    pinned_by: str | None = None  # the stored response that pins it there
    body_for: Callable[[Instance], bytes] | None = None  # the body each attempt sends, by its instance
    watch: Callable[[bytes], None] | None = None  # shown the answer (a whole one, or each run of events)


def read_model_only(raw: bytes, only_model: str | None) -> AgentRead:
    """A request routed by load and model alone (count_tokens, tokenizer and pooling routes)."""
    head = convert(json_object(raw), _ModelOnly)
    return AgentRead(CompletionRequest(model=served_model(head.model, only_model)), tokenize=False)


def convert(fields: dict[str, Any], kind: type[Any]) -> Any:
    """fields as kind, or a 400 naming what does not fit."""
    try:
        return msgspec.convert(fields, kind, strict=False)
    except msgspec.ValidationError as exc:
        raise bad_request(f"Invalid request body: {exc}", "invalid_field") from None
