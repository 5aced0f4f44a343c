"""An Anthropic Messages body as the chat completions request vLLM 0.32 serves it.

vLLM answers ``/v1/messages`` and ``/v1/messages/count_tokens`` by converting the body into a chat request
(``AnthropicServingMessages.to_chat_completion_request``) and rendering that as any chat. This module builds
the same chat, so that the router tokenizes it as a chat and gets the engine's ids:

- one leading system message: the top-level ``system`` (a string as is; of blocks, the non-empty text ones
  but Claude Code's billing header, joined with nothing between them);
- each message in turn: text blocks as text parts (one alone: a plain string), thinking blocks joined into
  ``reasoning``, ``tool_use`` blocks as tool calls whose arguments are ``json.dumps`` of the input; each
  ``tool_result`` in a user message becomes a tool message placed before it (a user message left empty is
  dropped); redacted thinking and tool references count for nothing;
- ``tools`` as chat tools, after the ``tool_addition``/``tool_removal`` blocks of system messages, with
  ``tool_choice`` "auto" when tools are given without one;
- ``output_config.effort`` as ``reasoning_effort``; ``thinking: disabled`` as the effort the server found
  the template takes for "off".

Two of vLLM's choices depend on the served chat template, found by trying it (``template_probes``): whether
system messages inside ``messages`` are merged into the leading one (a template that refuses a system
message after the first turn), and the effort that stands for disabled thinking. Without them, a body whose
prompt depends on either raises ``InvalidPrompt``. So does anything this module cannot render as vLLM does
(documents, unknown block types, a value of the wrong JSON type): the router then routes it without prefix
knowledge, and the engine answers it. Images become chat image parts, as vLLM's, which the chat path keys
(router/prompt/multimodal/) or routes by load.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.sandbox

from router.apis.openai_body import chat_endpoint_template_kwargs, lax_bool
from router.prompt.chat_conversation import InvalidPrompt
from router.prompt.template_inputs import TemplateInputs

if TYPE_CHECKING:
    from router.prompt.tokenization import PromptTokenizer

_BILLING_HEADER = "x-anthropic-billing-header"
_ROLES = ("user", "assistant", "system")
_EFFORTS = ("low", "medium", "high", "xhigh", "max")  # vLLM's AnthropicEffort, in the probe's order
_THINKING = ("enabled", "disabled", "adaptive")
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
_TOOL_CHANGES = ("tool_addition", "tool_removal")
# vLLM's AnthropicContentBlock: its types, and the JSON type of each field it declares (null always allowed)
_BLOCK_TYPES = frozenset(
    {
        "text",
        "image",
        "tool_use",
        "tool_result",
        "tool_reference",
        "thinking",
        "redacted_thinking",
        *_TOOL_CHANGES,
    }
)
_BLOCK_FIELDS: dict[str, type | tuple[type, ...]] = {
    "text": str,
    "source": dict,
    "id": str,
    "tool_use_id": str,
    "name": str,
    "input": dict,
    "content": (str, list),
    "tool_name": str,
    "thinking": str,
    "signature": str,
    "data": str,
    "tool": dict,
}


@dataclass(frozen=True, slots=True)
class TemplateProbes:
    """What vLLM's Anthropic server decides once per model by trying the chat template."""

    merge_inline_system: bool  # system messages inside ``messages`` join the leading system message
    disabled_thinking_effort: str  # the reasoning_effort of ``thinking: disabled``: "none", or "low"


@lru_cache(maxsize=16)
def template_probes(tokenizer: PromptTokenizer) -> TemplateProbes:
    """The probes as vLLM runs them on the template ``tokenizer`` renders chats with."""
    no_tools: list[Any] = []  # vLLM tries the template picked without tools and the one picked for []
    merge = any(_needs_system_first(tokenizer.template_text(tools)) for tools in (None, no_tools))
    return TemplateProbes(merge, _disabled_thinking_effort(tokenizer))


def anthropic_chat_body(body: Mapping[str, Any], probes: TemplateProbes | None = None) -> dict[str, Any]:
    """The chat completions body (JSON-able dict) vLLM's to_chat_completion_request builds from an Anthropic
    Messages body: model, messages, max_tokens, stream, tools, tool_choice, chat_template_kwargs, ... exactly
    the fields and values that change the rendered prompt, in vLLM's message/field order.

    probes: the served template's (``template_probes``); None: a body whose prompt depends on them raises
    ``InvalidPrompt``. Sampling-only fields (temperature, stop, thinking's budget, output format...) are left
    out; so are those of a count_tokens body that its endpoint ignores."""
    if not isinstance(body, Mapping):
        raise InvalidPrompt("the body must be an object")
    messages = _checked_messages(body.get("messages"))
    chat: dict[str, Any] = {}
    if isinstance(body.get("model"), str):
        chat["model"] = body["model"]
    system = _system_message(body.get("system"), messages, probes)
    chat["messages"] = system + _chat_messages(messages, probes)
    if not chat["messages"]:
        raise InvalidPrompt("nothing to render: no system prompt and no message with content")
    if type(body.get("max_tokens")) is int:
        chat["max_tokens"] = body["max_tokens"]
    if lax_bool(body.get("stream")):
        chat["stream"] = True
    template_kwargs = body.get("chat_template_kwargs")
    if template_kwargs is not None:
        if not isinstance(template_kwargs, dict):
            raise InvalidPrompt("chat_template_kwargs must be an object")
        chat["chat_template_kwargs"] = template_kwargs
    effort = _reasoning_effort(body, probes)
    if effort is not None:
        chat["reasoning_effort"] = effort
    tool_choice = _tool_choice(body.get("tool_choice"))
    tools = _tools(body.get("tools"), messages)
    if tools is not None and tool_choice is None:
        tool_choice = "auto"  # vLLM's conversion sets it, so the server's auto tool choice must be on
    if tool_choice is not None:
        chat["tool_choice"] = tool_choice
    if tools is not None:
        chat["tools"] = tools
    for key in ("cache_salt", "vllm_xargs"):  # what the router reads beside the prompt
        if body.get(key) is not None:
            chat[key] = body[key]
    return chat


def _checked_messages(messages: Any) -> list[Mapping[str, Any]]:
    if not isinstance(messages, list):
        raise InvalidPrompt("messages must be a list")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or message.get("role") not in _ROLES:
            raise InvalidPrompt(f"messages[{index}] must be an object with role user, assistant or system")
        content = message.get("content")
        if not isinstance(content, str | list):
            raise InvalidPrompt(f"messages[{index}].content must be a string or a list of blocks")
        for block in content if isinstance(content, list) else ():
            _check_block(block, f"messages[{index}]")
            if block["type"] in _TOOL_CHANGES and message["role"] != "system":
                raise InvalidPrompt(f"messages[{index}]: {block['type']} only in system messages")
    return messages


def _check_block(block: Any, where: str) -> None:
    kind = block.get("type") if isinstance(block, Mapping) else None
    if not (isinstance(kind, str) and kind in _BLOCK_TYPES):
        raise InvalidPrompt(f"{where}: a content block of an unknown type")
    for field, kind in _BLOCK_FIELDS.items():
        value = block.get(field)
        if value is not None and not isinstance(value, kind):
            raise InvalidPrompt(f"{where}: a {block['type']} block's {field} has the wrong type")
    if block.get("is_error") is not None and lax_bool(block["is_error"]) is None:
        raise InvalidPrompt(f"{where}: a tool_result's is_error must be a boolean")
    content = block.get("content")
    if isinstance(content, list) and not all(isinstance(item, dict) for item in content):
        raise InvalidPrompt(f"{where}: a tool_result's content items must be objects")


def _system_message(
    system: Any, messages: list[Mapping[str, Any]], probes: TemplateProbes | None
) -> list[dict[str, Any]]:
    """The leading system message: the top-level system, and (merged) the system messages' text."""
    parts: list[str] = []
    if isinstance(system, str):
        parts += [system] if system else []
    elif isinstance(system, list):
        for block in system:
            _check_block(block, "system")
            if block["type"] in _TOOL_CHANGES:
                raise InvalidPrompt(f"system: {block['type']} only in system messages")
        parts += _texts(system)
    elif system is not None:
        raise InvalidPrompt("system must be a string or a list of blocks")
    inline = [text for message in messages if message["role"] == "system" if (text := _system_text(message))]
    if inline:
        if probes is None:
            raise InvalidPrompt("where system messages go depends on the template: no probes given")
        if probes.merge_inline_system:
            parts += inline
    return [{"role": "system", "content": "".join(parts)}] if parts else []


def _texts(blocks: Sequence[Mapping[str, Any]]) -> list[str]:
    """The non-empty text blocks' texts, Claude Code's billing header (new on every request) left out."""
    return [
        block["text"]
        for block in blocks
        if block["type"] == "text" and block.get("text") and not block["text"].startswith(_BILLING_HEADER)
    ]


def _system_text(message: Mapping[str, Any]) -> str:
    content = message["content"]
    if isinstance(content, str):
        return "" if content.startswith(_BILLING_HEADER) else content
    return "".join(_texts(content))


def _chat_messages(messages: list[Mapping[str, Any]], probes: TemplateProbes | None) -> list[dict[str, Any]]:
    converted: list[dict[str, Any]] = []
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "system":
            text = _system_text(message)
            if text and probes is not None and not probes.merge_inline_system:
                converted.append({"role": "system", "content": text})
            continue
        chat_message: dict[str, Any] = {"role": role}
        if isinstance(content, str):
            chat_message["content"] = content
        else:
            _convert_blocks(content, role, chat_message, converted)
        if not (role == "user" and "content" not in chat_message):
            converted.append(chat_message)
    return converted


def _image_url(source: Mapping[str, Any]) -> str:
    """An image block's source (an object: checked with the block) as vLLM's Messages endpoint hands it on:
    its URL, or its data as a data URL."""
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _convert_blocks(
    blocks: list[Mapping[str, Any]], role: str, chat_message: dict[str, Any], converted: list[dict[str, Any]]
) -> None:
    """Fills chat_message from the blocks, in vLLM's key order: reasoning, tool_calls, content. A user's
    tool results go to ``converted`` as tool messages ahead of it."""
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in blocks:
        kind = block["type"]
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and block.get("source"):  # as vLLM passes it on: a chat image part
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
        elif kind == "thinking" and block.get("thinking") is not None:
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            calls.append(_tool_call(block))
        elif kind == "tool_result" and role == "user":
            converted.append(_tool_message(block))
        elif kind == "tool_result":  # vLLM writes Python's str() of the content
            parts.append(
                {
                    "type": "text",
                    "text": f"Tool result: {str(block['content']) if block.get('content') else ''}",
                }
            )
    if reasoning:
        chat_message["reasoning"] = "".join(reasoning)
    if calls:
        chat_message["tool_calls"] = calls
    if parts:
        chat_message["content"] = parts[0]["text"] if len(parts) == 1 else parts


def _tool_call(block: Mapping[str, Any]) -> dict[str, Any]:
    if not block.get("id"):  # vLLM makes one from the clock
        raise InvalidPrompt("a tool_use block without an id")
    arguments = json.dumps(block.get("input") or {})
    return {
        "id": block["id"],
        "type": "function",
        "function": {"name": block.get("name") or "", "arguments": arguments},
    }


def _tool_message(block: Mapping[str, Any]) -> dict[str, Any]:
    """A user's tool result: its text items joined with newlines (vLLM reads a missing text as "")."""
    content = block.get("content")
    texts = [content] if isinstance(content, str) else []
    for item in content if isinstance(content, list) else ():
        kind = item.get("type")
        if kind in ("image", "tool_reference"):  # each becomes a message of its own
            raise InvalidPrompt("a tool_result holding images or tool references is not rendered here")
        if kind == "text":
            if not isinstance(item.get("text", ""), str):
                raise InvalidPrompt("a tool_result's text item without a string text")
            texts.append(item.get("text", ""))
    return {"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": "\n".join(texts)}


def _tools(tools: Any, messages: list[Mapping[str, Any]]) -> list[dict[str, Any]] | None:
    """The chat tools: the request's, after the system messages' tool additions and removals."""
    if tools is not None and not isinstance(tools, list):
        raise InvalidPrompt("tools must be a list")
    declared = None if tools is None else [_tool(tool, f"tools[{index}]") for index, tool in enumerate(tools)]
    changes = [
        block
        for message in messages
        if isinstance(message["content"], list)
        for block in message["content"]
        if block["type"] in _TOOL_CHANGES
    ]
    if changes:
        declared = _changed(declared or [], changes)
    if declared is None:
        return None
    return [{"type": "function", "function": _function(tool)} for tool in declared]


def _tool(tool: Any, where: str) -> dict[str, Any]:
    """An Anthropic tool as vLLM's model validates it: an input schema without a type gets "object"."""
    if not isinstance(tool, Mapping) or not isinstance(tool.get("name"), str):
        raise InvalidPrompt(f"{where} must be an object with a string name")
    description, schema = tool.get("description"), tool.get("input_schema")
    if not (description is None or isinstance(description, str)) or not isinstance(schema, dict):
        raise InvalidPrompt(f"{where} needs an object input_schema and a string description")
    checked = {"name": tool["name"], "description": description, "input_schema": schema}
    if "type" not in schema:
        checked["input_schema"] = {**schema, "type": "object"}
    for flag in ("strict", "defer_loading"):
        value = tool.get(flag)
        if value is not None and lax_bool(value) is None:
            raise InvalidPrompt(f"{where}.{flag} must be a boolean")
        checked[flag] = None if value is None else lax_bool(value)
    return checked


def _changed(tools: list[dict[str, Any]], changes: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The tools in effect at the end of the conversation (vLLM's _resolve_tools)."""
    by_name = {tool["name"]: tool for tool in tools}
    removed: set[str] = set()
    for block in changes:
        change = block.get("tool")
        if not isinstance(change, Mapping):
            raise InvalidPrompt(f"{block['type']} needs a tool")
        kind = change.get("type")
        if kind == "tool_definition" and block["type"] == "tool_addition":
            name = (tool := _tool(change.get("definition"), "a tool_definition"))["name"]
            by_name[name] = tool
        elif kind == "tool_reference" and isinstance(change.get("name"), str):
            name = change["name"]
            if name not in by_name:
                raise InvalidPrompt(f"{block['type']} names tool {name!r}, which is not declared")
            if block["type"] == "tool_addition":
                by_name[name] = by_name[name] | {"defer_loading": None}
        else:
            raise InvalidPrompt(f"{block['type']} needs a tool_reference or (to add) a tool_definition")
        if block["type"] == "tool_removal":
            removed.add(name)
        else:
            removed.discard(name)
    return [tool for name, tool in by_name.items() if name not in removed]


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    function = {"name": tool["name"], "description": tool["description"], "parameters": tool["input_schema"]}
    return function | {flag: tool[flag] for flag in ("strict", "defer_loading") if tool[flag] is not None}


def _tool_choice(choice: Any) -> Any:
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, Mapping) else None
    if isinstance(kind, str) and kind in _TOOL_CHOICES:
        return _TOOL_CHOICES[kind]
    if kind == "tool" and isinstance(choice.get("name"), str) and choice["name"]:
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidPrompt("tool_choice must be auto, any, none, or a tool with its name")


def _reasoning_effort(body: Mapping[str, Any], probes: TemplateProbes | None) -> str | None:
    """output_config's effort, which ``thinking: disabled`` overrides with the probed effort."""
    output_config, thinking = body.get("output_config"), body.get("thinking")
    effort = output_config.get("effort") if isinstance(output_config, Mapping) else None
    if output_config is not None and not isinstance(output_config, Mapping):
        raise InvalidPrompt("output_config must be an object")
    if effort not in (None, *_EFFORTS):
        raise InvalidPrompt("output_config.effort must be one of " + ", ".join(_EFFORTS))
    kind = thinking.get("type") if isinstance(thinking, Mapping) else None
    if thinking is not None and kind not in _THINKING:
        raise InvalidPrompt("thinking.type must be " + ", ".join(_THINKING))
    if kind != "disabled":
        return effort
    if probes is None:
        raise InvalidPrompt("the effort of disabled thinking depends on the template: no probes given")
    return probes.disabled_thinking_effort


def _needs_system_first(template: str | None) -> bool:
    """vLLM's check: the template fails on [system, user, system, user], rendered in its own sandbox with
    nothing else defined (so a template that needs ``eos_token`` fails too)."""
    if not template:
        return True
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    turns = [{"role": role, "content": "t"} for role in ("system", "user", "system", "user")]
    try:
        environment.from_string(template).render(messages=turns, add_generation_prompt=False)
    except jinja2.TemplateError:
        return True
    return False


def _disabled_thinking_effort(tokenizer: PromptTokenizer) -> str:
    """ "low" where the template fails with reasoning_effort "none" or renders it as one of the efforts."""

    def rendered(effort: str) -> str | None:
        kwargs = chat_endpoint_template_kwargs(None, effort)
        try:
            return tokenizer.render_chat(
                [{"role": "user", "content": "Hi"}], inputs=TemplateInputs(template_kwargs=kwargs)
            )
        except Exception:  # vLLM takes any failure as "none" not being understood
            return None

    off = rendered("none")
    if off is None or any(rendered(effort) == off for effort in _EFFORTS):
        return "low"
    return "none"
