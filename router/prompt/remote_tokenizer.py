"""Token ids from an instance's ``POST /tokenize`` (vLLM's API): the fallback without a local tokenizer
(router/prompt/token_cache.py), and what the tokenization audit (router/prompt/tokenization_audit.py) checks
the local ids against."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
import msgspec

from router.bounded_read import read_at_most
from router.prompt.tokenization import completion_text_or_ids

ANSWER_BYTES_PER_REQUEST_BYTE = 16  # a token id of up to 6 digits and its comma, for each byte of prompt
ANSWER_SLACK_BYTES = 64 * 2**10  # the answer's other fields
_JSON = {"content-type": "application/json"}


class TokenizeFailed(Exception):
    """An instance's /tokenize gave no usable answer; the message and ``__cause__`` say why."""


class _TokenizeResponse(msgspec.Struct):
    count: int
    tokens: list[int]


_decode_response = msgspec.json.Decoder(_TokenizeResponse).decode


class RemoteTokenizer:
    """Token ids from an instance's ``POST /tokenize`` (vLLM's API), through the caller's session."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        model: str,
        timeout_s: float = 10.0,
        instance: str = "",
    ) -> None:
        """instance: its name, in logs and metrics (its URL is not shown)."""
        self.session, self.model = session, model
        self.instance = instance or base_url
        self.url = base_url.rstrip("/") + "/tokenize"
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def chat_ids(
        self,
        messages: Sequence[Any],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        template_inputs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """template_inputs: tools, chat_template, chat_template_kwargs, rendered by the engine itself."""
        return await self._tokenize(
            {
                "model": self.model,
                "messages": list(messages),
                "add_generation_prompt": add_generation_prompt,
                "continue_final_message": continue_final_message,
                "add_special_tokens": add_special_tokens,
                **(template_inputs or {}),
            }
        )

    async def completion_ids(self, prompt: Any, add_special_tokens: bool = True) -> list[int]:
        """Token ids are the engine's prompt as they are; vLLM's /tokenize takes text only."""
        text_or_ids = completion_text_or_ids(prompt)
        if isinstance(text_or_ids, list):
            return text_or_ids
        body = {"model": self.model, "prompt": text_or_ids, "add_special_tokens": add_special_tokens}
        return await self._tokenize(body)

    async def _tokenize(self, body: dict[str, Any]) -> list[int]:
        request = msgspec.json.encode(body)
        # An answer lists at most a token per byte of the prompt, in a few bytes each: a larger one is not
        # /tokenize's, and is not read into memory (an engine answering every path with a huge body).
        limit = ANSWER_BYTES_PER_REQUEST_BYTE * len(request) + ANSWER_SLACK_BYTES
        try:
            async with self.session.post(
                self.url, data=request, headers=_JSON, timeout=self.timeout
            ) as response:
                status = response.status
                payload = await read_at_most(response, limit)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise TokenizeFailed(f"POST {self.url} failed: {exc!r}") from exc
        if payload is None:
            raise TokenizeFailed(f"POST {self.url} answered more than {limit} bytes")
        if status != 200:
            raise TokenizeFailed(f"POST {self.url} answered {status}: {payload[:200]!r}")
        try:
            decoded = _decode_response(payload)
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            raise TokenizeFailed(f"POST {self.url} answered an unreadable body: {exc}") from exc
        if decoded.count != len(decoded.tokens):
            raise TokenizeFailed(
                f"POST {self.url} answered count {decoded.count} for {len(decoded.tokens)} ids"
            )
        return decoded.tokens
