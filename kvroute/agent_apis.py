"""The APIs an agent session can speak: its turn's request body, and what the streamed answer says.

- chat: ``POST /v1/chat/completions``, the whole history as messages; usage from the stream's usage chunk.
- responses: ``POST /v1/responses`` (OpenAI Responses, as Codex speaks it): ``instructions`` = the system
  prompt, the whole history as input items, ``store: false``. With ``chain``, each turn sends only what
  the last stored response does not hold, after its ``previous_response_id`` (``store: true``), so only
  the instance that stored it can answer. The stream ends with ``response.completed``, whose usage counts
  the prompt.
- messages: ``POST /v1/messages`` (Anthropic Messages, as Claude Code speaks it): ``system``, the whole
  history as user/assistant messages. The stream ends with ``message_stop``; ``message_delta``'s usage
  splits the prompt into ``input_tokens`` and the cache's read and creation tokens.

Nothing here does I/O: kvroute/agent_sessions.py posts the bodies and feeds every decoded SSE event to
read_event.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

Api = Literal["chat", "responses", "messages"]
APIS: tuple[Api, ...] = ("chat", "responses", "messages")
PATHS: dict[Api, str] = {
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}
# What a stream that stops before its API's last event is missing (chat: any chunk with a choice).
LAST_EVENT: dict[Api, str] = {
    "chat": "a chunk",
    "responses": "response.completed",
    "messages": "message_stop",
}


@dataclass
class History:
    """A session's conversation: its system prompt and its texts, the user's and the assistant's in turn
    (a failed turn's reply is empty, as a client that got nothing would record it)."""

    system: str
    texts: list[str] = field(default_factory=list)
    previous_response_id: str = ""  # chain: the last response stored ...
    stored: int = 0  # ... and how many of texts its stored conversation holds
    images: dict[int, str] = field(default_factory=dict)  # a user text's image (a data: URL), by its index

    def answered(self, reply: str, stored_as: str = "") -> None:
        """Record the assistant's reply; stored_as: the id of the stored response that holds it."""
        self.texts.append(reply)
        if stored_as:
            self.previous_response_id, self.stored = stored_as, len(self.texts)

    def turns(self, start: int = 0) -> list[tuple[str, str]]:
        """(role, text) of the texts from start on."""
        return [("user" if i % 2 == 0 else "assistant", self.texts[i]) for i in range(start, len(self.texts))]


def request_body(
    api: Api, history: History, model: str, max_tokens: int, chain: bool = False
) -> dict[str, Any]:
    """The streamed request of the history's next turn (its last text is the user's)."""
    if api == "responses":
        return responses_body(history, model, max_tokens, chain)
    if chain:
        raise ValueError("a chain of stored responses needs the responses API")
    if api == "messages":
        return {
            "model": model,
            "system": history.system,
            "messages": [{"role": role, "content": text} for role, text in history.turns()],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        }
    return {
        "model": model,
        "messages": [
            {"role": "system", "content": history.system},
            *(
                {"role": role, "content": _chat_content(text, history.images.get(index))}
                for index, (role, text) in enumerate(history.turns())
            ),
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _chat_content(text: str, image: str | None) -> str | list[dict[str, Any]]:
    """A chat message's content: its text, and the image it carries as a part after it."""
    if image is None:
        return text
    return [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": image}}]


def responses_body(history: History, model: str, max_tokens: int, chain: bool) -> dict[str, Any]:
    # vLLM keeps no instructions from a previous response (research doc §1.3): they are sent every turn.
    follows = chain and bool(history.previous_response_id)
    body: dict[str, Any] = {
        "model": model,
        "instructions": history.system,
        "input": [_input_item(role, text) for role, text in history.turns(history.stored if follows else 0)],
        "max_output_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "store": chain,
    }
    if follows:
        body["previous_response_id"] = history.previous_response_id
    return body


def _input_item(role: str, text: str) -> dict[str, Any]:
    """A Responses input item as Codex sends them: the user's input_text, the assistant's earlier output
    message (vLLM reads an assistant item with list content only when it is typed "message")."""
    part = "input_text" if role == "user" else "output_text"
    return {"type": "message", "role": role, "content": [{"type": part, "text": text}]}


@dataclass
class StreamReading:
    """What a turn's stream has said so far; times are seconds since the request was sent."""

    text: list[str] = field(default_factory=list)
    first_text: float = 0.0  # the first delta with text: the TTFT
    first_output: float = 0.0  # the first sign of output at all (a reply that decodes to nothing has one)
    prompt_tokens: int = 0
    finished: bool = False  # the API's last event came
    error: str = ""  # an error event's message
    response_id: str = ""  # responses: the id the response was stored under

    @property
    def ttft(self) -> float:
        return self.first_text or self.first_output

    def output(self, now: float, text: str = "") -> None:
        self.first_output = self.first_output or now
        if text:
            self.first_text = self.first_text or now
            self.text.append(text)


def read_chat_chunk(chunk: dict[str, Any], reading: StreamReading, now: float) -> None:
    for choice in chunk.get("choices") or ():
        reading.output(now, (choice.get("delta") or {}).get("content") or "")
        reading.finished = True  # a chat stream has no last event of its own; a choice is an answer
    usage = chunk.get("usage")
    if usage:
        reading.prompt_tokens = int(usage.get("prompt_tokens") or 0)


def read_responses_event(event: dict[str, Any], reading: StreamReading, now: float) -> None:
    kind = event.get("type")
    if kind == "response.output_text.delta":
        reading.output(now, str(event.get("delta") or ""))
    elif kind == "response.output_item.added":
        reading.output(now)
    elif kind in ("response.completed", "response.incomplete"):  # incomplete: max_output_tokens reached
        response = event.get("response") or {}
        reading.prompt_tokens = int((response.get("usage") or {}).get("input_tokens") or 0)
        reading.response_id = str(response.get("id") or "")
        reading.finished = True
    elif kind == "response.failed":
        error = (event.get("response") or {}).get("error") or {}
        reading.error = str(error.get("message") or "response.failed")
    elif kind == "error":
        reading.error = str(event.get("message") or event.get("code") or "error event")


def read_messages_event(event: dict[str, Any], reading: StreamReading, now: float) -> None:
    kind = event.get("type")
    if kind == "message_start":  # vLLM's first chunk: the whole prompt as input_tokens, no cache fields
        usage = (event.get("message") or {}).get("usage") or {}
        reading.prompt_tokens = int(usage.get("input_tokens") or 0)
    elif kind == "content_block_start":
        reading.output(now)
    elif kind == "content_block_delta":
        delta = event.get("delta") or {}
        reading.output(now, str(delta.get("text") or "") if delta.get("type") == "text_delta" else "")
    elif kind == "message_delta" and event.get("usage"):
        reading.prompt_tokens = anthropic_prompt_tokens(event["usage"])
    elif kind == "message_stop":
        reading.finished = True
    elif kind == "error":
        reading.error = str((event.get("error") or {}).get("message") or "error event")


def anthropic_prompt_tokens(usage: dict[str, Any]) -> int:
    """The whole prompt: Anthropic's input_tokens leave out what the cache read or wrote."""
    parts = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    return sum(int(usage.get(part) or 0) for part in parts)


READERS: dict[Api, Callable[[dict[str, Any], StreamReading, float], None]] = {
    "chat": read_chat_chunk,
    "responses": read_responses_event,
    "messages": read_messages_event,
}
