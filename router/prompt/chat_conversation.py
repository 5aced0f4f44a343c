"""The conversation and tool list vLLM's chat endpoint hands the chat template, built from a request's JSON.

vLLM 0.32 (``renderers/chat_utils.py``, ``parse_chat_messages``, and the request's validators) does not pass
messages through as sent. It keeps only the fields below; for a template that reads content as a string
(router/prompt/template_reading.py) it joins text parts with newlines and drops empty ones, for one that
loops over content parts it passes every message's content as a list of text parts (plain strings too; a tool
result's parts joined back into one string); it strips Claude Code's per-request billing header from system
text, parses each assistant tool call's ``arguments`` string into an object (``{}`` when it is not one),
drops an empty ``tool_calls``, renames the deprecated ``reasoning_content`` to ``reasoning`` and passes both
to the template. A template that never names the "developer" role gets developer messages as one merged system
message. Tools are dumped as its ``ChatCompletionToolsParam`` model: ``description`` and ``parameters``
always present (null when absent), ``strict`` and ``defer_loading`` only when set.

Templates read these dicts as they are (``tojson`` keeps key order), so the router's ids equal the engine's
only if they match field for field. Anything outside what is built here raises ``InvalidPrompt``: the router
then asks an instance's ``/tokenize`` (a chat with tools or kwargs) or routes without prefix knowledge.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

from router.prompt.multimodal.chat_images import ChatImages, is_image_part
from router.prompt.template_reading import content_format, template_variables


class InvalidPrompt(ValueError):
    """The request's messages or prompt cannot be tokenized; the message says why."""


_TEXT_FIELDS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "thinking": "thinking",
    "refusal": "refusal",
}
_BILLING_HEADER = "x-anthropic-billing-header"
_FUNCTION_OPTIONAL = ("strict", "defer_loading")
# The fields vLLM's content part types declare; a text part's other fields reach the template with it.
_PART_FIELDS = frozenset(
    {
        "audio_embeds",
        "audio_url",
        "closed",
        "data",
        "file",
        "image_embeds",
        "image_pil",
        "image_url",
        "input_audio",
        "name",
        "prompt_cache_breakpoint",
        "refusal",
        "text",
        "thinking",
        "type",
        "uuid",
        "video_embeds",
        "video_url",
    }
)


def engine_conversation(
    messages: Sequence[Any],
    template: str | None,
    calls_as_given: bool = False,
    images: ChatImages | None = None,
) -> list[dict[str, Any]]:
    """The messages as vLLM renders them with ``template`` (the model's chat template text).

    calls_as_given: assistant tool calls reach the template as given, only their arguments parsed in place,
    as on vLLM's Responses path (router/apis/responses/chat.py); the chat request model re-lays them.
    images: where a template reading content as a string gets images, as their placeholders (kept there)."""
    as_parts = template is not None and content_format(template) == "openai"
    laid_out_images = None if as_parts else images
    conversation = [
        _message(message, index, as_parts, calls_as_given, laid_out_images)
        for index, message in enumerate(engine_messages(messages))
    ]
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


def engine_template_kwargs(template_kwargs: Mapping[str, Any], template: str | None) -> dict[str, Any]:
    """The request's ``chat_template_kwargs`` that vLLM passes to ``template``: the variables it reads (it
    drops the others). A key that is also a parameter of ``apply_chat_template`` (``tools``, ``truncation``,
    ``add_generation_prompt``...) is merged with vLLM's own arguments in ways not reproduced here."""
    if template is None:
        raise InvalidPrompt("the model has no chat template to read chat_template_kwargs with")
    if overlap := template_kwargs.keys() & _apply_chat_template_parameters():
        raise InvalidPrompt(f"chat_template_kwargs sets apply_chat_template's own {sorted(overlap)}")
    reads = template_variables(template)
    return {key: value for key, value in template_kwargs.items() if key in reads}


@cache
def _apply_chat_template_parameters() -> frozenset[str]:
    from transformers import PreTrainedTokenizerBase

    parameters = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters.values()
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return frozenset(p.name for p in parameters if p.kind not in variadic) | {"chat_template", "tokenize"}


def _message(
    message: Any, index: int, as_parts: bool, calls_as_given: bool, images: ChatImages | None = None
) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise InvalidPrompt(f"messages[{index}] must be an object")
    role = message.get("role")
    if not isinstance(role, str):
        raise InvalidPrompt(f"messages[{index}].role must be a string")
    before = 0 if images is None else len(images.parts)
    parts = _parts(message.get("content"), index, role == "system", as_parts, images)
    content: str | list[dict[str, Any]]
    if not as_parts:
        content = "\n".join(part["text"] for part in parts if part["text"])
        if images is not None and len(images.parts) > before:
            if images.placeholder in content:  # vLLM would count it as one of the images
                raise InvalidPrompt(f"messages[{index}]'s text holds the image placeholder itself")
            content = images.content(len(images.parts) - before, content)
    elif role == "tool":  # vLLM hands templates a tool result's text parts as one string
        content = "\n".join(part["text"] for part in parts)
    else:
        content = parts
    built: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant":
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            calls = _calls_as_given(tool_calls, index) if calls_as_given else _tool_calls(tool_calls, index)
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


def _parts(
    content: Any, index: int, strip_billing_header: bool, as_parts: bool, images: ChatImages | None = None
) -> list[dict[str, Any]]:
    """The content's text parts as vLLM lays them out for a template that loops over them: each part's
    text, and the fields vLLM does not know. Claude Code's attribution line changes on every request; vLLM
    drops it from a system message's plain text parts (and the part, if nothing else is left). Image parts
    go to images, where given."""
    if content is None:
        return []
    if isinstance(content, str):
        content = [content]
    elif not isinstance(content, list):
        raise InvalidPrompt(f"messages[{index}].content must be a string or a list of text parts")
    parts = []
    for part in content:
        kind, text = _text_part(part)
        if kind is None and images is not None and is_image_part(part):
            images.parts.append(part)
            continue
        if kind is None:
            raise InvalidPrompt(f"messages[{index}].content: only text parts are supported")
        if strip_billing_header and kind in ("", "text") and (text or "").startswith(_BILLING_HEADER):
            text = (text or "").partition("\n")[2]
            if not text:
                continue
        if text is None and not (as_parts and kind not in ("text", "refusal")):
            continue  # vLLM skips these; as parts, the other kinds pass with a null text
        text_part: dict[str, Any] = {"type": "text", "text": text}
        if as_parts and kind != "":  # the fields vLLM does not know reach the template; a joined string not
            text_part |= {key: value for key, value in part.items() if key not in _PART_FIELDS}
        parts.append(text_part)
    return parts


def _text_part(part: Any) -> tuple[str | None, str | None]:
    """A content part's kind ("" for a plain string) and text (None: a text part without one); kind None:
    not a text part (or one with a ``uuid``, which vLLM reads as media)."""
    if isinstance(part, str):
        return "", part
    kind = part.get("type") if isinstance(part, Mapping) else None
    field = _TEXT_FIELDS.get(kind) if isinstance(kind, str) else None
    text = part.get(field) if field is not None else None
    if field is None or not (text is None or isinstance(text, str)) or part.get("uuid") is not None:
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
        calls.append(
            _fields_first(
                {"id": call["id"], "function": _fields_first(laid_out, function), "type": "function"}, call
            )
        )
    return calls


def _calls_as_given(tool_calls: Any, index: int) -> list[dict[str, Any]]:
    """Each call with its fields in the order given and its arguments an object: vLLM's
    ``_postprocess_messages`` parses a string in place, keeps an object, and makes anything else ``{}``."""
    if not isinstance(tool_calls, list):
        raise InvalidPrompt(f"messages[{index}].tool_calls must be a list")
    calls = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or call.get("type", "function") != "function":
            raise InvalidPrompt(f"messages[{index}].tool_calls: only function calls are supported")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            arguments = _arguments(arguments)
        elif not isinstance(arguments, dict):
            arguments = {}
        calls.append({**call, "function": {**function, "arguments": arguments}})
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
    contents = (_joined(converted[index]["content"]) for index in systems)
    merged = "\n\n".join(content for content in contents if content)
    rest = [message for message in converted if message["role"] != "system"]
    return [{"role": "system", "content": merged}, *rest]


def _joined(content: str | list[dict[str, Any]]) -> str:
    return content if isinstance(content, str) else "\n".join(part["text"] for part in content)


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
