"""Errors in the Anthropic Messages API's shape, as vLLM 0.32's ``/v1/messages`` routes answer them.

vLLM's Anthropic router (``translate_error_response``) turns the error its chat code returns,
``{"error": {"message", "type", "param", "code"}}``, into ``{"type": "error", "error": {"type", "message"}}``
with the same status; the type stays vLLM's own name (``NotFoundError``, ``BadRequestError``...), not one of
Anthropic's. Errors raised before its handler runs (a body its request model rejects, a body that is not JSON)
keep OpenAI's shape. The bytes are Starlette's JSONResponse rendering: compact, non-ASCII left as it is.
"""

from __future__ import annotations

import json
from typing import Any


def anthropic_error_body(openai_error_body: bytes) -> bytes:
    """An error in OpenAI's shape ({"error":{"message","type","param","code"}}) as vLLM's anthropic router
    answers it: {"type":"error","error":{"type": <type>, "message": <message>}} (vLLM's
    translate_error_response).

    A body in no such shape (Starlette's ``{"detail": ...}``, the auth middleware's ``{"error": "..."}``) is
    returned as it is, as vLLM passes those on."""
    try:
        fields: Any = json.loads(openai_error_body)
    except (ValueError, RecursionError):  # not JSON, or not UTF-8
        return openai_error_body
    error = fields.get("error") if isinstance(fields, dict) else None
    if not isinstance(error, dict):
        return openai_error_body
    message, kind = error.get("message"), error.get("type")
    if not (isinstance(message, str) and isinstance(kind, str)):
        return openai_error_body
    return anthropic_error(message, kind)


def anthropic_error(message: str, kind: str) -> bytes:
    """The error body vLLM's Anthropic routes answer, with ``kind`` as its type."""
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
