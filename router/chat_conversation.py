"""The conversation and tool list vLLM's chat endpoint hands the chat template, built from a request's JSON.

vLLM 0.32 (``renderers/chat_utils.py``, ``parse_chat_messages`` with the "string" content format, and the
request's validators) does not pass messages through as sent. It keeps only the fields below, joins text
parts with newlines and drops empty ones, strips Claude Code's per-request billing header from system text,
parses each assistant tool call's ``arguments`` string into an object (``{}`` when it is not one), drops an
empty ``tool_calls``, renames the deprecated ``reasoning_content`` to ``reasoning`` and passes both to the
template. A template that never names the "developer" role gets developer messages as one merged system
message. Tools are dumped as its ``ChatCompletionToolsParam`` model: ``description`` and ``parameters``
always present (null when absent), ``strict`` and ``defer_loading`` only when set.

Templates read these dicts as they are (``tojson`` keeps key order), so the router's ids equal the engine's
only if they match field for field. Anything outside what is built here raises ``InvalidPrompt``: the router
then asks an instance's ``/tokenize`` (a chat with tools) or routes without prefix knowledge.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any


class InvalidPrompt(ValueError):
    """The request's messages or prompt cannot be tokenized; the message says why."""


_TEXT_FIELDS = {"text": "text", "input_text": "text", "output_text": "text", "thinking": "thinking",
                "refusal": "refusal"}  # fmt: skip
_BILLING_HEADER = "x-anthropic-billing-header"
_FUNCTION_OPTIONAL = ("strict", "defer_loading")


def engine_conversation(messages: Sequence[Any], template: str | None) -> list[dict[str, Any]]:
    """The messages as vLLM renders them with ``template`` (the model's chat template text)."""
    conversation = [_message(message, index) for index, message in enumerate(engine_messages(messages))]
    if any(message["role"] == "developer" for message in conversation) and not _names_developer(template):
        conversation = _developer_as_system(conversation)
    return conversation


def engine_messages(messages: Sequence[Any]) -> list[Any]:
    """The messages as vLLM's chat request model passes them on, for its other endpoints (``/tokenize``
    keeps the deprecated ``reasoning_content`` that the chat endpoint renames)."""
    return [_renamed(message) if isinstance(message, Mapping) else message for message in messages]


def _renamed(message: Mapping[str, Any]) -> Any:
    if "reasoning_content" not in message:
        return message
    renamed = {key: value for key, value in message.items() if key != "reasoning_content"}
    if renamed.get("reasoning") is None and message["reasoning_content"] is not None:
        renamed["reasoning"] = message["reasoning_content"]
    return renamed


def engine_tools(tools: Sequence[Any]) -> list[dict[str, Any]]:
    """``tools`` as vLLM's ``[tool.model_dump() for tool in request.tools]`` lays them out."""
    return [_tool(tool, index) for index, tool in enumerate(tools)]


def _message(message: Any, index: int) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise InvalidPrompt(f"messages[{index}] must be an object")
    role = message.get("role")
    if not isinstance(role, str):
        raise InvalidPrompt(f"messages[{index}].role must be a string")
    parts = _parts(message.get("content"), index, strip_billing_header=role == "system")
    built: dict[str, Any] = {"role": role, "content": "\n".join(part for part in parts if part)}
    if role == "assistant":
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            calls = _tool_calls(tool_calls, index)
            if calls:
                built["tool_calls"] = calls
        reasoning = message.get("reasoning")
        if reasoning is not None:
            built["reasoning"] = built["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in message:
        built["tool_call_id"] = message["tool_call_id"]
    for key in ("name", "task"):
        if isinstance(message.get(key), str):
            built[key] = message[key]
    if role == "developer":
        built["tools"] = message.get("tools")
    return built


def _parts(content: Any, index: int, strip_billing_header: bool) -> list[str]:
    """The texts of the content's parts. Claude Code's attribution line changes on every request; vLLM
    drops it from a system message's plain text parts."""
    if content is None:
        return []
    if isinstance(content, str):
        content = [content]
    elif not isinstance(content, list):
        raise InvalidPrompt(f"messages[{index}].content must be a string or a list of text parts")
    texts = []
    for part in content:
        kind, text = _text_part(part)
        if kind is None:
            raise InvalidPrompt(f"messages[{index}].content: only text parts are supported")
        if text is not None and strip_billing_header and kind == "text" and text.startswith(_BILLING_HEADER):
            text = text.partition("\n")[2]
        if text is not None:
            texts.append(text)
    return texts


def _text_part(part: Any) -> tuple[str | None, str | None]:
    """A content part's kind and text (None: a text part without one); kind None: not a text part."""
    if isinstance(part, str):
        return "text", part
    kind = part.get("type") if isinstance(part, Mapping) else None
    field = _TEXT_FIELDS.get(kind) if isinstance(kind, str) else None
    text = part.get(field) if field is not None else None
    if field is None or not (text is None or isinstance(text, str)):
        return None, None
    return kind, text


def _tool_calls(tool_calls: Any, index: int) -> list[dict[str, Any]]:
    """Each call's fields in the order vLLM's request model validates them into (extra fields last)."""
    if not isinstance(tool_calls, list):
        raise InvalidPrompt(f"messages[{index}].tool_calls must be a list")
    calls = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        if (
            not isinstance(function, Mapping)
            or call.get("type") != "function"
            or not isinstance(call.get("id"), str)
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)
        ):
            raise InvalidPrompt(f"messages[{index}].tool_calls: only function calls with an id are supported")
        laid_out = {"arguments": _arguments(function["arguments"]), "name": function["name"]}
        calls.append(_fields_first({"id": call["id"], "function": _fields_first(laid_out, function),
                                    "type": "function"}, call))  # fmt: skip
    return calls


def _fields_first(fields: dict[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    return fields | {key: value for key, value in given.items() if key not in fields}


def _arguments(arguments: str) -> dict[str, Any]:
    """A call's arguments as the template gets them: an object; what is not one becomes {}."""
    try:
        parsed = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _names_developer(template: str | None) -> bool:
    return template is not None and ('"developer"' in template or "'developer'" in template)


def _developer_as_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Developer messages become system ones, and every system message merges into one at the front."""
    converted = []
    for message in conversation:
        if message["role"] == "developer":
            message = {key: value for key, value in message.items() if key != "tools"} | {"role": "system"}
        converted.append(message)
    systems = [index for index, message in enumerate(converted) if message["role"] == "system"]
    if systems in ([], [0]):
        return converted
    merged = "\n\n".join(converted[index]["content"] for index in systems if converted[index]["content"])
    rest = [message for message in converted if message["role"] != "system"]
    return [{"role": "system", "content": merged}, *rest]


def _tool(tool: Any, index: int) -> dict[str, Any]:
    function = tool.get("function") if isinstance(tool, Mapping) else None
    if not isinstance(function, Mapping) or tool.get("type", "function") != "function":
        raise InvalidPrompt(f"tools[{index}] must be a function tool")
    name, description = function.get("name"), function.get("description")
    parameters = function.get("parameters")
    if not isinstance(name, str) or not (description is None or isinstance(description, str)):
        raise InvalidPrompt(f"tools[{index}].function needs a string name and description")
    if not (parameters is None or isinstance(parameters, dict)):
        raise InvalidPrompt(f"tools[{index}].function.parameters must be an object")
    dumped: dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
    for key in _FUNCTION_OPTIONAL:
        value = function.get(key)
        if key == "defer_loading" and value is None:
            value = tool.get("defer_loading")  # the tool's own flag reaches its function
        if value is not None:
            if not isinstance(value, bool):
                raise InvalidPrompt(f"tools[{index}].function.{key} must be a boolean")
            dumped[key] = value
    laid_out: dict[str, Any] = {"type": "function", "function": dumped}
    if tool.get("defer_loading") is not None:
        laid_out["defer_loading"] = tool["defer_loading"]
    return laid_out
