"""The few fields of OpenAI request bodies that routing reads, decoded once at the edge.

The body itself is forwarded byte for byte (but for one vLLM field, see without_full_kv_report); unknown
fields are the engine's business.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar, get_type_hints

import msgspec

from router.errors import OpenAIError, bad_request, not_utf8

DATA_PARALLEL_RANK_HEADER = "X-data-parallel-rank"  # vLLM: the engine of a data parallel server to use


class ChatRequest(msgspec.Struct):
    messages: list[Any]
    model: str = ""  # none: the only model served (vLLM's server takes its own); see decode_body
    stream: bool | None = None
    user: str | None = None
    # vLLM's extensions that change the prompt's tokens, with vLLM's defaults
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    cache_salt: str | None = None  # vLLM's: the prompt's cache entries are the salt's alone
    # Template inputs: tools and kwargs the router renders itself (router/prompt/chat_conversation.py); for a
    # request's own template, and for what it cannot render, it asks an instance's /tokenize
    tools: list[Any] | None = None
    tool_choice: Any = None  # "none" leaves the tools out where the engines are told to
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Any = None  # reaches the template as kwargs, see template_kwargs
    # A template input no tokenizer endpoint takes: such requests are routed without prefix knowledge
    documents: Any = None
    truncate_prompt_tokens: Any = None  # the engine cuts the prompt: routed without prefix knowledge
    vllm_xargs: Any = None  # see without_full_kv_report
    priority: Any = None  # vLLM's; the router sets it (router/dispatch/intake/engine_priority.py)

    def template_kwargs(self) -> dict[str, Any] | None:
        return chat_endpoint_template_kwargs(self.chat_template_kwargs, self.reasoning_effort)

    def engine_template_inputs(self) -> dict[str, Any]:
        """What, beside the messages and flags, an instance's /tokenize needs to render this chat as the chat
        endpoint will."""
        inputs = {
            "tools": self.tools,
            "chat_template": self.chat_template,
            "chat_template_kwargs": self.template_kwargs(),
        }
        return {key: value for key, value in inputs.items() if value is not None}


class ResponsesChatRequest(ChatRequest):
    """A Responses request as the chat vLLM renders it (router/apis/responses/chat.py): its tool calls
    reach the template in the order vLLM's Responses code builds them, not the chat endpoint's."""


def chat_endpoint_template_kwargs(
    given: dict[str, Any] | None, reasoning_effort: Any
) -> dict[str, Any] | None:
    """The ``chat_template_kwargs`` vLLM's chat endpoint renders with: the request's, and with a
    ``reasoning_effort`` that value and ``enable_thinking`` (unless the request's kwargs set it), so that
    templates which only know the latter think when asked to. A key set to null or "auto" is left unset, as
    vLLM merges the request's kwargs over its defaults."""
    kwargs = dict(given or {})
    if reasoning_effort is not None:
        kwargs["reasoning_effort"] = reasoning_effort
        if "enable_thinking" not in kwargs:
            kwargs["enable_thinking"] = reasoning_effort != "none"
    set_ = {key: value for key, value in kwargs.items() if not _unset(value)}
    return set_ or None


def _unset(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value == "auto")


class CompletionRequest(msgspec.Struct):
    prompt: str | list[Any] | None = None  # or prompt_embeds (vLLM's --enable-prompt-embeds)
    prompt_embeds: Any = None  # routed without prefix knowledge: the index keys token ids
    model: str = ""
    stream: bool | None = None
    user: str | None = None
    add_special_tokens: bool = True
    cache_salt: str | None = None
    truncate_prompt_tokens: Any = None
    vllm_xargs: Any = None
    priority: Any = None


Body = TypeVar("Body", ChatRequest, CompletionRequest)

# Not strict: booleans given as 0 / 1 or "true" / "false", which vLLM's validation takes, are taken too.
_decoders: dict[type[Any], msgspec.json.Decoder[Any]] = {
    kind: msgspec.json.Decoder(kind, strict=False) for kind in (ChatRequest, CompletionRequest)
}
BOM = b"\xef\xbb\xbf"  # before JSON, Python's json (vLLM's) skips it
_PARAM = re.compile(r"at `\$\.(\w+)")
_MISSING = re.compile(r"missing required field `(\w+)`")


def decode_body(raw: bytes, kind: type[Body], only_model: str | None = None) -> Body:
    """only_model: the model a body without one is for (vLLM's server takes its own); None: it must name
    one."""
    raw = _content(raw)
    try:
        body: Body = _decoders[kind].decode(raw)
    except msgspec.ValidationError as exc:
        lax = _as_vllm_reads_it(raw, kind)
        if lax is not None:
            return decode_body(lax, kind, only_model)
        text = str(exc)
        found = _PARAM.search(text) or _MISSING.search(text)
        param = found.group(1) if found else None
        raise bad_request(f"Invalid request body: {text}", "invalid_field", param) from None
    except msgspec.DecodeError as exc:
        raise not_json(raw, exc) from None
    except UnicodeDecodeError:  # msgspec before 0.23, for a string that is no UTF-8 (not_json: from 0.23)
        raise not_utf8() from None
    if isinstance(body, ChatRequest):
        if not body.messages:
            raise bad_request("`messages` must hold at least one message.", "invalid_field", "messages")
        _check_tool_call_arguments(body.messages)
    if isinstance(body, CompletionRequest) and body.prompt is None and body.prompt_embeds is None:
        raise bad_request("`prompt` or `prompt_embeds` is required.", "invalid_field", "prompt")
    body.model = served_model(body.model, only_model)
    return body


def json_object(raw: bytes) -> dict[str, Any]:
    """A body read as a plain JSON object (the agents' APIs), with decode_body's errors."""
    try:
        fields = msgspec.json.decode(_content(raw))
    except msgspec.DecodeError as exc:
        raise not_json(raw, exc) from None
    except RecursionError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}", "invalid_json") from None
    except UnicodeDecodeError:
        raise not_utf8() from None
    if not isinstance(fields, dict):
        raise bad_request("The request body must be a JSON object.", "invalid_json")
    return fields


# A high surrogate's escape that no low one's follows: msgspec calls it "Input data was truncated".
_LONE_HIGH_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])")


def not_json(raw: bytes, error: msgspec.DecodeError) -> OpenAIError:
    """The 400 for a body msgspec could not decode, saying what is wrong with it."""
    if not _is_utf8(raw):  # msgspec 0.23 raises DecodeError where earlier releases raised UnicodeDecodeError
        return not_utf8()
    reason = str(error)
    if reason == "Input data was truncated" and (lone := _LONE_HIGH_SURROGATE.search(raw)) is not None:
        escape = lone.group().decode()
        reason = f"JSON is malformed: a lone utf-16 surrogate {escape} (byte {lone.start()}) is no character"
    return bad_request(f"The request body is not valid JSON: {reason}", "invalid_json")


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode()
    except UnicodeDecodeError:
        return False
    return True


def served_model(named: str | None, only_model: str | None) -> str:
    """The model a body names; without one, only_model (vLLM's server takes its own), if the router serves
    one model only."""
    if named:
        return named
    if only_model is None:
        raise bad_request("`model` is required: the router serves several.", "invalid_field", "model")
    return only_model


def _content(raw: bytes) -> bytes:
    """raw without the BOM Python's json (vLLM's) skips; a 400 when there is nothing."""
    if not raw.strip():
        raise bad_request("The request body is empty; expected a JSON object.", "invalid_json")
    return raw.removeprefix(BOM)


# vLLM parses each tool call's arguments with json.loads, which fails past Python's recursion limit (~940
# levels where vLLM calls it) and answers 500: counted against the instance's circuit breaker, a client could
# open every breaker. No real call nests so deep.
MAX_ARGUMENTS_DEPTH = 512
# An escape (one unit, so \" is no quote), a quote or a bracket.
_JSON_STRUCTURE = re.compile(r'\\.|["\[\]{}]')


def _check_tool_call_arguments(messages: list[Any]) -> None:
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        for call in calls if isinstance(calls, list) else ():
            function = call.get("function") if isinstance(call, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            # Fewer opening brackets than the limit cannot nest deeper: the scan is for the rare rest.
            if (
                isinstance(arguments, str)
                and arguments.count("[") + arguments.count("{") > MAX_ARGUMENTS_DEPTH
                and nesting_depth(arguments) > MAX_ARGUMENTS_DEPTH
            ):
                raise bad_request(
                    f"A tool call's arguments nest deeper than {MAX_ARGUMENTS_DEPTH} levels.",
                    "invalid_tool_call_arguments",
                    "messages",
                )


def nesting_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in JSON text, brackets inside strings passed over; without
    recursion, so any depth is measured."""
    depth = deepest = 0
    in_string = False
    for found in _JSON_STRUCTURE.finditer(text):
        mark = found.group()
        if mark == '"':
            in_string = not in_string
        elif in_string or mark[0] == "\\":
            continue
        elif mark in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


# pydantic's lax booleans, which vLLM's request models take; msgspec takes true/false, 0/1 and "true"/"false"
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})
_BOOLEAN_FIELDS = {
    kind: [name for name, hint in get_type_hints(kind).items() if hint in (bool, bool | None)]
    for kind in (ChatRequest, CompletionRequest)
}
BOOLEAN_FIELDS = frozenset(name for names in _BOOLEAN_FIELDS.values() for name in names)  # of either body


def _as_vllm_reads_it(raw: bytes, kind: type[Body]) -> bytes | None:
    """The body with what vLLM takes and msgspec does not put as msgspec takes it: a null model (vLLM serves
    its own) left out, booleans such as "yes" or 1.0 made true or false. None when there is no such thing;
    the second decode then reports the real error. Only for decoding: the engine gets the body as sent."""
    try:
        fields = msgspec.json.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(fields, dict):
        return None
    changed = False
    if "model" in fields and fields["model"] is None:
        del fields["model"]
        changed = True
    for name in _BOOLEAN_FIELDS[kind]:
        value = fields.get(name)
        if value is not None and type(value) is not bool and (read := lax_bool(value)) is not None:
            fields[name], changed = read, True
    return msgspec.json.encode(fields) if changed else None


def lax_bool(value: Any) -> bool | None:
    """A boolean as pydantic's lax mode (vLLM's request models) reads value; None when it reads none."""
    if type(value) is bool:
        return value
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    if type(value) in (int, float) and value in (0, 1):
        return bool(value == 1)
    return None


_REPORT_MODE = "kv_cache_report_mode"


def without_full_kv_report(raw: bytes, xargs: Any) -> bytes:
    """The body without ``vllm_xargs.kv_cache_report_mode``. In its "full" mode vLLM announces every reused
    prefix block again as BlockStored, with no BlockRemoved to match, and the index would count each as one
    more copy of the block, crediting it after its eviction. The router is the events' consumer here, so it
    keeps vLLM's default (incremental) mode; the answer to the client does not depend on it. xargs: the
    body's ``vllm_xargs`` as decoded (a key spelled with JSON escapes is found there, not in the bytes)."""
    if not isinstance(xargs, dict) or _REPORT_MODE not in xargs:  # the common case: nothing to decode
        return raw
    try:  # what fails here decode_body took, and plain JSON cannot hold
        fields = msgspec.json.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return raw
    xargs = fields.get("vllm_xargs") if isinstance(fields, dict) else None
    if not isinstance(xargs, dict) or xargs.pop(_REPORT_MODE, None) is None:
        return raw
    if not xargs:
        del fields["vllm_xargs"]
    return msgspec.json.encode(fields)
