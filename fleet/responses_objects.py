"""The Responses API's objects and stream events laid out key for key as vLLM 0.32 sends them (non-harmony
models, no reasoning parser): ``ResponsesResponse.model_dump(mode="json", by_alias=True)`` and the events of
``SimpleStreamingEventProcessor`` for text.

Checked against a capture from real vLLM in tests/fleet/test_agent_api_fidelity.py.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fleet.engine import PromptCache

_LOGPROBS_INCLUDE = "message.output_text.logprobs"


def new_id(prefix: str) -> str:
    """vLLM's ids: a prefix and 16 hex digits (random_uuid)."""
    return prefix + uuid.uuid4().hex[:16]


@dataclass(frozen=True)
class ResponseEcho:
    """What every stored or streamed copy of one response repeats of its request, as vLLM's
    ``ResponsesResponse.from_request`` takes it (sampling values as the engine runs them)."""

    id: str
    created_at: int
    model: str
    request: Mapping[str, Any]
    max_output_tokens: int  # the budget the engine runs with

    def body(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        request = self.request
        temperature = float(_given(request, "temperature", 1.0))
        return {
            "id": self.id,
            "created_at": self.created_at,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": request.get("instructions"),
            "metadata": request.get("metadata"),
            "model": self.model,
            "object": "response",
            "output": output,
            "parallel_tool_calls": _given(request, "parallel_tool_calls", True),
            "temperature": temperature,
            "tool_choice": _given(request, "tool_choice", "auto"),
            "tools": [echoed_tool(tool) for tool in request.get("tools") or []],
            # greedy sampling resets top_p to its default
            "top_p": 1.0 if temperature == 0 else float(_given(request, "top_p", 1.0)),
            "background": bool(request.get("background")),
            "max_output_tokens": self.max_output_tokens,
            "max_tool_calls": request.get("max_tool_calls"),
            "previous_response_id": request.get("previous_response_id"),
            "prompt": None,
            "reasoning": _reasoning(request.get("reasoning")),
            "service_tier": _given(request, "service_tier", "auto"),
            "status": status,
            "text": _text(request.get("text")),
            "top_logprobs": _top_logprobs(request),
            "truncation": _given(request, "truncation", "disabled"),
            "usage": usage,
            "user": request.get("user"),
            "presence_penalty": float(_given(request, "presence_penalty", 0.0)),
            "frequency_penalty": float(_given(request, "frequency_penalty", 0.0)),
            "kv_transfer_params": kv_transfer_params,
            "ec_transfer_params": None,
            "input_messages": None,
            "output_messages": None,
        }


def _given(request: Mapping[str, Any], key: str, default: Any) -> Any:
    value = request.get(key)
    return default if value is None else value


def _top_logprobs(request: Mapping[str, Any]) -> int | None:
    include = request.get("include")
    if isinstance(include, list) and _LOGPROBS_INCLUDE in include:
        return int(_given(request, "top_logprobs", 0))
    return None


def _reasoning(reasoning: Any) -> Any:
    if not isinstance(reasoning, Mapping):
        return reasoning
    fields = ("context", "effort", "generate_summary", "mode", "summary")
    return {name: reasoning.get(name) for name in fields}


def _text(text: Any) -> Any:
    if not isinstance(text, Mapping):
        return text
    return {"format": text.get("format"), "verbosity": text.get("verbosity")}


# The openai SDK's tool models, field by field in their order (None where the request left one out).
_TOOL_FIELDS = {
    "function": (
        "name",
        "parameters",
        "strict",
        "type",
        "allowed_callers",
        "async",
        "defer_loading",
        "description",
        "output_schema",
    ),
    "custom": ("name", "type", "allowed_callers", "async", "defer_loading", "description", "format"),
    "web_search": ("type", "external_web_access", "filters", "search_context_size", "user_location"),
}
_NAMESPACED_FUNCTION_FIELDS = (
    "name",
    "type",
    "allowed_callers",
    "async",
    "defer_loading",
    "description",
    "output_schema",
    "parameters",
    "strict",
)


def echoed_tool(tool: Any) -> Any:
    """A request's tool as the response repeats it; a type not laid out here comes back as sent."""
    if not isinstance(tool, Mapping):
        return tool
    kind = tool.get("type")
    if kind == "namespace":
        functions = [
            {name: item.get(name) for name in _NAMESPACED_FUNCTION_FIELDS}
            if isinstance(item, Mapping)
            else item
            for item in tool.get("tools") or []
        ]
        return {
            "description": tool.get("description"),
            "name": tool.get("name"),
            "tools": functions,
            "type": kind,
        }
    fields = _TOOL_FIELDS.get(str(kind))
    return dict(tool) if fields is None else {name: tool.get(name) for name in fields}


def usage(prompt_tokens: int, output_tokens: int, cache: PromptCache) -> dict[str, Any]:
    """Always with the prompt's cached tokens (no server option needed, unlike chat completions)."""
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": cache.cached_tokens,
            "cache_write_tokens": cache.created_tokens,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": output_tokens,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": prompt_tokens + output_tokens,
    }


def output_text(text: str, logprobs: list[Any] | None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def output_message(item_id: str, text: str, status: str) -> dict[str, Any]:
    """An assistant message item; no text, no content part."""
    content = [output_text(text, None)] if text else []
    return {
        "id": item_id,
        "content": content,
        "role": "assistant",
        "status": status,
        "type": "message",
        "phase": None,
    }


class TextEvents:
    """The events of one response whose output is one text message, numbered as they are made. Their
    fields come in the SDK's (alphabetical) order."""

    def __init__(self) -> None:
        self.sequence_number = 0
        self.item_id = new_id("msg_")
        self.text = ""

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        fields.update(sequence_number=self.sequence_number, type=kind)
        self.sequence_number += 1
        return dict(sorted(fields.items()))

    def lifecycle(self, kind: str, response: dict[str, Any]) -> dict[str, Any]:
        """response.created, response.in_progress or response.completed."""
        return self._event(kind, response=response)

    def opened(self) -> list[dict[str, Any]]:
        return [
            self._event(
                "response.output_item.added",
                item=output_message(self.item_id, "", "in_progress"),
                output_index=0,
            ),
            self._event(
                "response.content_part.added",
                content_index=0,
                item_id=self.item_id,
                output_index=0,
                part=output_text("", []),
            ),
        ]

    def delta(self, text: str) -> dict[str, Any]:
        self.text += text
        return self._event(
            "response.output_text.delta",
            content_index=0,
            delta=text,
            item_id=self.item_id,
            logprobs=[],
            output_index=0,
        )

    def closed(self) -> list[dict[str, Any]]:
        common = {"content_index": 0, "item_id": self.item_id, "output_index": 0}
        return [
            self._event("response.output_text.done", **common, logprobs=[], text=self.text),
            self._event("response.content_part.done", **common, part=output_text(self.text, None)),
            self._event(
                "response.output_item.done",
                item=output_message(self.item_id, self.text, "completed"),
                output_index=0,
            ),
        ]
