"""A disaggregated answer's cached prompt tokens, as an aggregated answer would count them.

A decode instance counts the KV it fetched from the prefill instance as cached: with MooncakeConnector its
`usage.prompt_tokens_details.cached_tokens` says nearly the whole prompt, every turn. What the prompt found
cached is what the prefill leg found: its answer's count replaces the decode answer's (as vllm-router and
llm-d's sidecar do), in a whole answer and in a stream's usage chunk. Answers without the details (vLLM's
--enable-prompt-tokens-details off) pass as they are.

The same details are what the A/B reads of a stream: its usage chunk's prompt tokens and cached ones.
"""

from __future__ import annotations

from typing import Any

import msgspec

from router.dispatch.observe.usage import answer_usage

_DETAILS = b'"prompt_tokens_details"'
# What a usage reporting cached tokens holds, by API (chat's and completions' otherwise)
_CACHED_MARKERS = {"responses": b'"input_tokens_details"', "messages": b'"cache_read_input_tokens"'}
_encode = msgspec.json.Encoder().encode


def reported_cached_tokens(answer: bytes) -> int | None:
    """The cached prompt tokens an answer's usage reports, if it does."""
    reported = _reported(answer)
    return None if reported is None else reported[1]


def stream_cached_tokens(events: bytes, api: str = "chat") -> tuple[int, int] | None:
    """The prompt tokens and the cached ones a stream's usage chunk reports, if events (whole SSE events)
    hold it (a Responses stream's response.completed, an Anthropic one's message_delta)."""
    marker = _CACHED_MARKERS.get(api, _DETAILS)
    if marker not in events:
        return None
    for line in events.split(b"\n"):
        if line.startswith(b"data: ") and marker in line:
            reported = _reported(line[6:])
            if reported is not None and reported[1] is not None:
                return reported[0], reported[1]
    return None


def _reported(answer: bytes) -> tuple[int, int | None] | None:
    usage = answer_usage(answer)
    if usage is None or usage.prompt_tokens_details is None:
        return None
    return usage.prompt_tokens, usage.cached_tokens


def with_cached_tokens(payload: bytes, cached: int) -> bytes:
    """payload (a whole answer, or whole SSE events) with the cached tokens its usage reports made cached."""
    if _DETAILS not in payload:  # every chunk of a stream but its usage chunk
        return payload
    if payload.lstrip().startswith(b"{"):
        return _rewritten(payload, cached) or payload
    lines = payload.split(b"\n")
    for number, line in enumerate(lines):
        if line.startswith(b"data: ") and _DETAILS in line:
            event = _rewritten(line[6:].rstrip(b"\r"), cached)
            if event is not None:
                lines[number] = b"data: " + event
    return b"\n".join(lines)


def _rewritten(document: bytes, cached: int) -> bytes | None:
    try:
        answer: Any = msgspec.json.decode(document)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return None
    usage = answer.get("usage") if isinstance(answer, dict) else None
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    if not isinstance(details, dict) or "cached_tokens" not in details:
        return None
    details["cached_tokens"] = cached
    return _encode(answer)
