"""The conversations behind stored responses, so that a follow-up's prompt is known token for token.

A request naming `previous_response_id` carries only its new input; vLLM renders it after the messages the
previous response was rendered from and that response's output (router/apis/responses/chat.py). The router
keeps both for the responses it routed, as the instance keeps them, bounded by count and size: a follow-up
whose previous response is not here (made before a restart, through another worker or replica, or long ago)
still goes to the instance that holds it, routed without prefix knowledge.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

_MAX_ENTRIES = 16_384
_MAX_BYTES = 256 * 2**20  # of request and output JSON, the entries' size as charged
_COMPLETED = b"event: response.completed"


@dataclass(slots=True)
class Conversation:
    messages: Sequence[Mapping[str, Any]]  # what the response was rendered from (vLLM's msg_store entry)
    size: int
    output: list[Any] | None = None  # the response's output items, once it ended
    charged: int = 0


class ResponseHistory:
    def __init__(self, max_entries: int = _MAX_ENTRIES, max_bytes: int = _MAX_BYTES) -> None:
        self._entries: OrderedDict[str, Conversation] = OrderedDict()
        self._max_entries, self._max_bytes = max_entries, max_bytes
        self._bytes = 0
        # Told each conversation started and completed here (replicas' shared store:
        # router/shared/conversations.py).
        self.on_started: Callable[[str], None] | None = None
        self.on_kept: Callable[[str, Sequence[Mapping[str, Any]], list[Any]], None] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def started(self, key: str, messages: Sequence[Mapping[str, Any]], size: int) -> None:
        """A response that will be stored was sent: what it is rendered from, size its request's bytes."""
        self._put(key, Conversation(messages, size))
        if self.on_started is not None:
            self.on_started(key)

    def completed(self, key: str, answer: bytes) -> None:
        """A stored response's answer: a whole response, or stream events holding its response.completed."""
        entry = self._entries.get(key)
        if entry is None or entry.output is not None:
            return
        output = _output(answer)
        if output is None:
            return
        self._bytes -= entry.charged
        entry.output, entry.charged = output, entry.size + len(answer)
        self._bytes += entry.charged
        self._evict()
        if self.on_kept is not None:
            self.on_kept(key, entry.messages, output)

    def adopt(self, key: str, messages: Sequence[Mapping[str, Any]], output: list[Any], size: int) -> None:
        """A conversation completed elsewhere (another replica's, read from the shared store)."""
        self._put(key, Conversation(messages, size, output))

    def conversation(self, key: str) -> Conversation | None:
        """The previous response's messages and output; None unless both are known."""
        entry = self._entries.get(key)
        if entry is None or entry.output is None:
            return None
        self._entries.move_to_end(key)
        return entry

    def _put(self, key: str, entry: Conversation) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old.charged
        entry.charged = entry.size
        self._entries[key] = entry
        self._bytes += entry.charged
        self._evict()

    def _evict(self) -> None:
        while self._entries and (len(self._entries) > self._max_entries or self._bytes > self._max_bytes):
            _, dropped = self._entries.popitem(last=False)
            self._bytes -= dropped.charged


def _output(answer: bytes) -> list[Any] | None:
    """The output items of a whole response, or of the response.completed event among stream events."""
    document = answer
    if _COMPLETED in answer:
        start = answer.index(_COMPLETED)
        data = answer.find(b"data:", start)
        end = answer.find(b"\n", data)
        if data < 0:
            return None
        document = answer[data + 5 : end if end >= 0 else None]
    elif not answer.lstrip().startswith(b"{"):
        return None
    try:
        decoded = msgspec.json.decode(document)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return None
    response = decoded.get("response", decoded) if isinstance(decoded, dict) else None
    # A response cut at max_output_tokens is "incomplete", and stored as it is.
    if not isinstance(response, dict) or response.get("status") not in ("completed", "incomplete"):
        return None
    output = response.get("output")
    return output if isinstance(output, list) else None
