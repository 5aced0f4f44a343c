"""A ``POST /v1/responses`` body as the chat vLLM 0.32 renders for it (non-harmony: every model but gpt-oss).

vLLM turns the body into chat messages (``construct_input_messages``), chat-shaped tools
(``construct_tool_dicts``) and template flags (``ResponsesRequest.build_chat_params``), then renders them
through the chat template like a chat completion, but encodes the text with special tokens added. The rules
reproduced here, from ``vllm/entrypoints/openai/responses/utils.py`` and ``protocol.py``:

- ``instructions`` become a leading system message; a stored previous response contributes its messages (less
  the system ones) and the text of each content part of its output messages, one assistant message per part.
- Input items: function and custom tool calls join the tool calls of the assistant message just built (or
  start one), reasoning fills its ``reasoning`` and an assistant message its ``content`` when unset (or start
  one), tool outputs become tool messages, and user/system/developer messages pass through as sent.
- A last input message or reasoning item that is ``in_progress`` or ``incomplete`` is continued.
- Tools: functions as the chat endpoint dumps them, namespace functions as ``<namespace>__<name>``, a custom
  tool as a function taking one string; every other tool type is not shown to the model.

What this does not reproduce raises ``InvalidPrompt``: media, encrypted reasoning, item references, output
items other than messages and tool calls, grammar-constrained custom tools, ids forwarded for decode-side
reuse, and JSON that vLLM would refuse. Not modelled: the server's ``--default-chat-template-kwargs`` and
``truncation: "auto"`` cutting a prompt longer than the model's context.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from router.prompt.chat_conversation import InvalidPrompt
from router.prompt.multimodal.chat_images import is_image_part
from router.prompt.template_inputs import NO_INPUTS, TemplateInputs


@dataclass(frozen=True, slots=True)
class ResponsesChat:
    """What vLLM renders for a Responses request; token_ids gives its prompt's ids."""

    messages: list[dict[str, Any]]  # what vLLM keeps for this response, the next one's previous messages
    tools: (
        list[dict[str, Any]] | None
    )  # None: the request has no tools, or they are left out for tool_choice none
    add_generation_prompt: bool
    continue_final_message: bool
    template_kwargs: (
        dict[str, Any] | None
    )  # the request's chat_template_kwargs with vLLM's own (reasoning effort)

    def token_ids(self, tokenizer: ChatTokenizer) -> list[int]:
        """The prompt's ids as vLLM's Responses code tokenizes it: with the tokenizer's special tokens, tool
        calls as it builds them (router/dispatch/decide/decision.py does the same for a
        ResponsesChatRequest)."""
        return tokenizer.chat_ids(
            self.messages,
            self.add_generation_prompt,
            self.continue_final_message,
            add_special_tokens=True,
            inputs=TemplateInputs(self.tools, self.template_kwargs, calls_as_given=True),
        )


class ChatTokenizer(Protocol):
    def chat_ids(
        self,
        messages: Sequence[Any],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        inputs: TemplateInputs = NO_INPUTS,
    ) -> list[int]: ...


_PARTIAL = ("in_progress", "incomplete")
_STATUSES = (None, "in_progress", "completed", "incomplete")
_EFFORTS = (None, "none", "minimal", "low", "medium", "high", "xhigh", "max")
_PASSED_ROLES = ("user", "system", "developer")
_NAMESPACE_SEPARATOR = "__"
_CUSTOM_INPUT = "input"
_CUSTOM_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        _CUSTOM_INPUT: {"type": "string", "description": "The freeform text payload for this tool."}
    },
    "required": [_CUSTOM_INPUT],
    "additionalProperties": False,
}


def responses_chat(
    body: Mapping[str, Any],
    previous_messages: Sequence[Mapping[str, Any]] = (),
    previous_output: Sequence[Any] = (),
    exclude_tools_when_tool_choice_none: bool = False,
) -> ResponsesChat:
    """The chat vLLM renders for ``body``. With ``previous_response_id``: ``previous_messages`` is the
    previous response's ``ResponsesChat.messages`` and ``previous_output`` its ``output`` items as JSON."""
    if not isinstance(body, Mapping):
        raise InvalidPrompt("the body must be an object")
    request_input = body.get("input")
    if not isinstance(request_input, str | list):
        raise InvalidPrompt("input must be a string or a list of items")
    if body.get("previous_response_id") is not None and not previous_messages:
        raise InvalidPrompt("previous_response_id needs the previous response's messages")
    if _reuses_prompt_ids(body.get("kv_transfer_params")):
        raise InvalidPrompt("kv_transfer_params.prompt_token_ids replace the rendered prompt")
    messages = [
        *_instructions(body.get("instructions")),
        *_history(previous_messages, previous_output),
        *_input_messages(request_input),
    ]
    if not messages:
        raise InvalidPrompt("the conversation is empty")
    continues = _continues_final(request_input)
    return ResponsesChat(
        messages=messages,
        tools=_tools(body.get("tools"), body.get("tool_choice", "auto"), exclude_tools_when_tool_choice_none),
        add_generation_prompt=not continues,
        continue_final_message=continues,
        template_kwargs=_template_kwargs(body.get("chat_template_kwargs"), body.get("reasoning")),
    )


def _reuses_prompt_ids(kv_transfer_params: Any) -> bool:
    return isinstance(kv_transfer_params, Mapping) and kv_transfer_params.get("prompt_token_ids") is not None


def _instructions(instructions: Any) -> list[dict[str, Any]]:
    if not (instructions is None or isinstance(instructions, str)):
        raise InvalidPrompt("instructions must be a string")
    return [{"role": "system", "content": instructions}] if instructions else []


def _history(previous_messages: Sequence[Any], previous_output: Sequence[Any]) -> list[dict[str, Any]]:
    """The previous response's messages less its system ones (instructions do not carry over), then each text
    part of its output messages as an assistant message; its other output items (reasoning, calls) drop."""
    history = []
    for message in previous_messages:
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise InvalidPrompt("previous messages must be objects with a role")
        if message["role"] != "system":
            history.append(dict(message))
    for item in previous_output:
        if not isinstance(item, Mapping):
            raise InvalidPrompt("previous output items must be objects")
        if item.get("type") != "message":
            continue
        for part in _list(item.get("content"), "a previous output message's content"):
            history.append({"role": "assistant", "content": _output_text(part)})
    return history


def _input_messages(request_input: str | list[Any]) -> list[dict[str, Any]]:
    if isinstance(request_input, str):
        return [{"role": "user", "content": request_input}]
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(request_input):
        if not isinstance(item, Mapping):
            raise InvalidPrompt(f"input[{index}] must be an object")
        previous = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
        built = _item_message(item, previous, index)
        if built is not None:
            messages.append(built)
    return messages


def _item_message(
    item: Mapping[str, Any], previous: dict[str, Any] | None, index: int
) -> dict[str, Any] | None:
    """A new message for the item, or None when it went into ``previous`` (the last message, an assistant)."""
    kind = item.get("type", "message")
    if kind in ("function_call", "custom_tool_call"):
        return _joined(previous, "tool_calls", _tool_call(item, index))
    if kind == "reasoning":
        return _joined(previous, "reasoning", _reasoning_text(item, index))
    if kind in ("function_call_output", "custom_tool_call_output"):
        return {"role": "tool", "content": _tool_output(item, index), "tool_call_id": item.get("call_id")}
    if kind != "message":
        raise InvalidPrompt(f"input[{index}]: items of type {kind!r} are not supported")
    role = item.get("role")
    if role == "assistant":
        return _joined(previous, "content", _assistant_text(item, index))
    if role not in _PASSED_ROLES:
        raise InvalidPrompt(f"input[{index}].role must be user, system, developer or assistant")
    _input_content(item.get("content"), f"input[{index}].content")
    return dict(item)


def _joined(previous: dict[str, Any] | None, field: str, value: Any) -> dict[str, Any] | None:
    """vLLM fills the previous assistant message's unset field (appends a tool call), else starts one."""
    if field == "tool_calls":
        if previous is None:
            return {"role": "assistant", "tool_calls": [value]}
        previous.setdefault("tool_calls", []).append(value)
        return None
    if previous is not None and previous.get(field) is None:
        previous[field] = value
        return None
    return {"role": "assistant", field: value}


def _tool_call(item: Mapping[str, Any], index: int) -> dict[str, Any]:
    """The call as the chat template gets it, its fields in the order vLLM builds them."""
    call_id, name = item.get("call_id"), item.get("name")
    if not isinstance(call_id, str) or not isinstance(name, str):
        raise InvalidPrompt(f"input[{index}]: a tool call needs a string call_id and name")
    if item.get("type") == "custom_tool_call":
        return _call(call_id, name, _custom_arguments(item.get(_CUSTOM_INPUT), index))
    arguments, namespace = item.get("arguments"), item.get("namespace")
    if not isinstance(arguments, str) or not (namespace is None or isinstance(namespace, str)):
        raise InvalidPrompt(f"input[{index}]: a function call needs string arguments and namespace")
    if item.get("status") not in _STATUSES:
        raise InvalidPrompt(f"input[{index}].status is not a status")
    return _call(call_id, namespace + _NAMESPACE_SEPARATOR + name if namespace else name, arguments)


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "function": {"name": name, "arguments": arguments}, "type": "function"}


def _custom_arguments(payload: Any, index: int) -> str:
    """A custom tool's freeform input, as the arguments of the function it is shown as."""
    if not isinstance(payload, str):
        raise InvalidPrompt(f"input[{index}].input must be a string")
    return json.dumps({_CUSTOM_INPUT: payload}, ensure_ascii=False)


def _reasoning_text(item: Mapping[str, Any], index: int) -> str:
    """The first content text, else the first summary text, else ""; encrypted reasoning is not readable."""
    encrypted = item.get("encrypted_content")
    if encrypted or not (encrypted is None or isinstance(encrypted, str)):
        raise InvalidPrompt(f"input[{index}]: encrypted reasoning is not supported")
    if not (isinstance(item.get("id", ""), str) and item.get("status") in _STATUSES):
        raise InvalidPrompt(f"input[{index}]: a reasoning item's id and status are malformed")
    summary = _typed_texts(item.get("summary"), "summary_text", f"input[{index}].summary")
    content = item.get("content")
    texts = [] if content is None else _typed_texts(content, "reasoning_text", f"input[{index}].content")
    return (texts or summary or [""])[0]


def _typed_texts(parts: Any, kind: str, where: str) -> list[str]:
    texts = []
    for part in _list(parts, where):
        if not isinstance(part, Mapping) or part.get("type") != kind or not isinstance(part.get("text"), str):
            raise InvalidPrompt(f"{where}: parts must be {kind} with a text")
        texts.append(part["text"])
    return texts


def _tool_output(item: Mapping[str, Any], index: int) -> str | list[Any]:
    output, call_id = item.get("output"), item.get("call_id")
    if not ((call_id is None and item.get("type") == "function_call_output") or isinstance(call_id, str)):
        raise InvalidPrompt(f"input[{index}].call_id must be a string")
    return _input_content(output, f"input[{index}].output")


def _assistant_text(item: Mapping[str, Any], index: int) -> str:
    """vLLM keeps only an assistant message's first part: output_text parts when the item says it is a message
    (it reads them as an output message), input_text parts either way."""
    content, where = item.get("content"), f"input[{index}].content"
    if isinstance(content, str):
        if (
            item.get("type") == "message"
            and isinstance(item.get("id"), str)
            and item.get("status") in _STATUSES[1:]
        ):
            raise InvalidPrompt(
                f"{where}: vLLM reads a string as an output message's parts when id and status are set"
            )
        return content
    parts = _list(content, where)
    if not parts:
        raise InvalidPrompt(f"{where} is empty")
    if item.get("type") == "message" and {_part_type(part) for part in parts} <= {"output_text", "refusal"}:
        _check_output_message(item, index)
        return _output_text(parts[0])
    _input_content(parts, where)
    return str(parts[0]["text"])


def _check_output_message(item: Mapping[str, Any], index: int) -> None:
    """What vLLM needs to read the item as an output message; else it would refuse it or misread it."""
    if not (isinstance(item.get("id", ""), str) and item.get("status", "completed") in _STATUSES[1:]):
        raise InvalidPrompt(f"input[{index}]: an output message's id and status are malformed")
    for part in item["content"]:
        field = "text" if part["type"] == "output_text" else "refusal"
        annotations = part.get("annotations", [])
        if not isinstance(part.get(field), str) or not isinstance(annotations, list):
            raise InvalidPrompt(f"input[{index}].content: a part's {field} or annotations are malformed")
        if not all(isinstance(annotation, Mapping) for annotation in annotations):
            raise InvalidPrompt(f"input[{index}].content: a part's annotations are malformed")
        if not (part.get("logprobs") is None or isinstance(part["logprobs"], list)):
            raise InvalidPrompt(f"input[{index}].content: a part's logprobs are malformed")


def _part_type(part: Any) -> str | None:
    kind = part.get("type") if isinstance(part, Mapping) else None
    return kind if isinstance(kind, str) else None


def _output_text(part: Any) -> str:
    if (
        not isinstance(part, Mapping)
        or part.get("type") != "output_text"
        or not isinstance(part.get("text"), str)
    ):
        raise InvalidPrompt("an output message's parts must be output_text with a text")
    return str(part["text"])


def _input_content(content: Any, where: str) -> str | list[Any]:
    """A string, or input_text parts (vLLM's chat parser reads them as text parts) and input_image parts with
    an image_url (read as images: router/prompt/multimodal/)."""
    if isinstance(content, str):
        return content
    parts = _list(content, where)
    for part in parts:
        if not isinstance(part, Mapping):
            raise InvalidPrompt(f"{where}: parts must be objects")
        if part.get("type") == "input_image" and is_image_part(part):
            continue
        if part.get("type") != "input_text" or not isinstance(part.get("text"), str):
            raise InvalidPrompt(f"{where}: only input_text and input_image parts are supported")
    return parts


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise InvalidPrompt(f"{where} must be a list")
    return value


def _continues_final(request_input: str | list[Any]) -> bool:
    """vLLM continues a last input message or reasoning item that is in progress or incomplete."""
    if isinstance(request_input, str) or not request_input:
        return False
    last = request_input[-1]
    return last.get("type", "message") in ("message", "reasoning") and last.get("status") in _PARTIAL


def _tools(tools: Any, tool_choice: Any, exclude_when_none: bool) -> list[dict[str, Any]] | None:
    """The function tools the model is shown, in request order; [] when tools name none of them."""
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise InvalidPrompt("tools must be a list")
    if not tools or (tool_choice == "none" and exclude_when_none):
        return None
    shown = []
    for index, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        if not isinstance(kind, str):
            raise InvalidPrompt(f"tools[{index}] needs a type")
        if kind == "function":
            shown.append(
                _function_tool(tool, tool["name"] if isinstance(tool.get("name"), str) else None, index)
            )
        elif kind == "custom":
            shown.append(_custom_tool(tool, index))
        elif kind == "namespace":
            shown.extend(_namespace_tools(tool, index))
    return shown


def _function_tool(tool: Mapping[str, Any], name: str | None, index: int) -> dict[str, Any]:
    """The tool as vLLM's chat tool model dumps it: strict and defer_loading only when set."""
    description, parameters = tool.get("description"), tool.get("parameters")
    if name is None or not (description is None or isinstance(description, str)):
        raise InvalidPrompt(f"tools[{index}] needs a string name and description")
    if not (parameters is None or isinstance(parameters, dict)):
        raise InvalidPrompt(f"tools[{index}].parameters must be an object")
    function: dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
    for key in ("strict", "defer_loading"):
        value = tool.get(key)
        if not (value is None or isinstance(value, bool)):
            raise InvalidPrompt(f"tools[{index}].{key} must be a boolean")
        if value is not None:
            function[key] = value
    return {"type": "function", "function": function}


def _custom_tool(tool: Mapping[str, Any], index: int) -> dict[str, Any]:
    """A freeform custom tool is shown as a function taking one string; a grammar vLLM refuses."""
    tool_format = tool.get("format")
    if not (tool_format is None or (isinstance(tool_format, Mapping) and tool_format.get("type") == "text")):
        raise InvalidPrompt(f"tools[{index}]: only free-form custom tools are supported")
    shim = {
        "name": tool.get("name"),
        "description": tool.get("description"),
        "parameters": _CUSTOM_PARAMETERS,
    }
    return _function_tool(shim, shim["name"] if isinstance(shim["name"], str) else None, index)


def _namespace_tools(tool: Mapping[str, Any], index: int) -> list[dict[str, Any]]:
    """A namespace's function tools, named ``<namespace>__<name>``; its custom tools are not shown."""
    namespace, members = tool.get("name"), tool.get("tools")
    if not isinstance(namespace, str) or not isinstance(tool.get("description"), str):
        raise InvalidPrompt(f"tools[{index}]: a namespace needs a string name and description")
    shown = []
    for member in _list(members, f"tools[{index}].tools"):
        kind = member.get("type") if isinstance(member, Mapping) else None
        if kind == "function":
            name = member.get("name")
            flat = namespace + _NAMESPACE_SEPARATOR + name if isinstance(name, str) else None
            shown.append(_function_tool(member, flat, index))
        elif kind != "custom":
            raise InvalidPrompt(f"tools[{index}].tools: only function and custom tools are supported")
    return shown


def _template_kwargs(chat_template_kwargs: Any, reasoning: Any) -> dict[str, Any] | None:
    """The request's chat_template_kwargs under vLLM's own: the reasoning effort, and ``enable_thinking``
    (effort not "none") unless the request sets it; vLLM's generation flags are ResponsesChat's fields. A None
    or "auto" value counts as unset: vLLM merges the request's kwargs over the server's defaults, which are
    never empty (``cohere_format``, read by Cohere's renderer only), and that merge drops those values."""
    if not (chat_template_kwargs is None or isinstance(chat_template_kwargs, dict)):
        raise InvalidPrompt("chat_template_kwargs must be an object")
    if not (reasoning is None or isinstance(reasoning, Mapping)):
        raise InvalidPrompt("reasoning must be an object")
    given = chat_template_kwargs or {}
    effort = reasoning.get("effort") if reasoning is not None else None
    if effort not in _EFFORTS:
        raise InvalidPrompt("reasoning.effort is not an effort")
    own: dict[str, Any] = {"add_generation_prompt": None, "continue_final_message": None}
    if effort is not None:
        own["reasoning_effort"] = effort
        if "enable_thinking" not in given:
            own["enable_thinking"] = effort != "none"
    merged = given | own
    kwargs = {key: value for key, value in merged.items() if not (value is None or value == "auto")}
    return kwargs or None
