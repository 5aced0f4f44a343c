"""An answer's `usage`, as vLLM's answers report it, in each API's terms: the one parser of it.

Chat and completions: prompt_tokens and prompt_tokens_details.cached_tokens. Responses: input_tokens and
input_tokens_details.cached_tokens, at the top of a whole response and inside a stream's response.completed.
Anthropic Messages: input_tokens counts what was not cached, beside cache_read_input_tokens and
cache_creation_input_tokens (present with vLLM's --enable-prompt-tokens-details), in a whole message and in
a stream's message_delta. All read as the chat's terms.
"""

from __future__ import annotations

import json

import msgspec


class PromptDetails(msgspec.Struct):
    cached_tokens: int | None = None  # vLLM reports it with --enable-prompt-tokens-details


class Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: PromptDetails | None = None

    @property
    def cached_tokens(self) -> int | None:
        """The prompt tokens the engine found cached, if it says."""
        details = self.prompt_tokens_details
        return None if details is None else details.cached_tokens


class _AnyUsage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    prompt_tokens_details: PromptDetails | None = None
    input_tokens: int | None = None  # the agents' APIs
    output_tokens: int = 0
    input_tokens_details: PromptDetails | None = None  # Responses
    cache_read_input_tokens: int | None = None  # Anthropic's
    cache_creation_input_tokens: int | None = None

    def as_chat(self) -> Usage:
        if self.prompt_tokens is not None or self.input_tokens is None:
            return Usage(self.prompt_tokens or 0, self.completion_tokens, self.prompt_tokens_details)
        if self.cache_read_input_tokens is None and self.cache_creation_input_tokens is None:
            return Usage(self.input_tokens, self.output_tokens, self.input_tokens_details)
        cached = self.cache_read_input_tokens or 0
        prompt = self.input_tokens + cached + (self.cache_creation_input_tokens or 0)
        return Usage(prompt, self.output_tokens, PromptDetails(cached))


class _Response(msgspec.Struct):
    usage: _AnyUsage | None = None


class _Answer(msgspec.Struct):
    usage: _AnyUsage | None = None
    response: _Response | None = None  # a Responses stream's response.completed event


_decode_answer = msgspec.json.Decoder(_Answer).decode


def answer_usage(payload: bytes) -> Usage | None:
    """A whole answer's (or one stream event's) usage, if it has one."""
    try:
        answer = _decode_answer(payload)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):  # nested past its depth, not UTF-8
        return None
    usage = answer.usage
    if usage is None and answer.response is not None:
        usage = answer.response.usage
    return None if usage is None else usage.as_chat()


_USAGE_KEY = b'"usage"'


def tail_usage(tail: bytes) -> Usage | None:
    """The usage of a whole answer too long to hold, from its last bytes: vLLM writes it near the end, after
    the choices. The last "usage" key in them is the answer's: a choice's text holds its quotes escaped."""
    start = tail.rfind(_USAGE_KEY)
    if start < 0:
        return None
    rest = tail[start + len(_USAGE_KEY) :].lstrip().removeprefix(b":").lstrip()
    try:
        value, _ = json.JSONDecoder().raw_decode(rest.decode())
        return msgspec.convert(value, _AnyUsage).as_chat()
    except (ValueError, msgspec.ValidationError):  # UnicodeDecodeError is a ValueError
        return None
