"""An answer's `usage`, as OpenAI's answers (and vLLM's) report it: the one parser of it."""

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


class _Answer(msgspec.Struct):
    usage: Usage | None = None


_decode_answer = msgspec.json.Decoder(_Answer).decode


def answer_usage(payload: bytes) -> Usage | None:
    """A whole answer's (or one stream event's) usage, if it has one."""
    try:
        return _decode_answer(payload).usage
    except (msgspec.DecodeError, RecursionError):  # an engine's answer nested past the decoder's depth
        return None


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
        return msgspec.convert(value, Usage)
    except (ValueError, msgspec.ValidationError):  # UnicodeDecodeError is a ValueError
        return None
