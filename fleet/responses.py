"""Response bodies and stream chunks laid out key for key as vLLM 0.32 sends them.

Checked against a capture from real vLLM in tests/fleet/test_vllm_fidelity.py.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fleet.engine import PromptCache

SYSTEM_FINGERPRINT = "vllm-0.32.0-kvroute-fleet"


def usage(
    prompt_tokens: int, completion_tokens: int, stream: bool, details: dict[str, Any] | None = None
) -> dict[str, Any]:
    """details: prompt_tokens_details (vLLM's --enable-prompt-tokens-details), or None."""
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if not stream:
        body.update(prompt_tokens_details=details, completion_tokens_details=None)
    elif details is not None:
        body["prompt_tokens_details"] = details
    return body


def prompt_tokens_details(cache: PromptCache, chat: bool, stream: bool) -> dict[str, Any]:
    """As vLLM 0.32 writes them: completions report cached tokens only, and a stream's usage chunk leaves
    out what is unset or null."""
    if stream:
        if chat:
            return {"cached_tokens": cache.cached_tokens, "created_cache_tokens": cache.created_tokens}
        return {"cached_tokens": cache.cached_tokens}
    created = cache.created_tokens if chat else None
    return {"cached_tokens": cache.cached_tokens, "created_cache_tokens": created, "multimodal_tokens": None}


@dataclass
class Envelope:
    """What every body and chunk of one response shares."""

    chat: bool
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:16]

    def _head(self, stream: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def body(
        self,
        text: str,
        finish_reason: str,
        prompt_tokens: int,
        completion_tokens: int,
        cache: PromptCache | None = None,
    ) -> dict[str, Any]:
        """cache: what the prompt found cached, for the usage's details (None: vLLM's default, none)."""
        head = self._head(stream=False)
        if self.chat:
            message: dict[str, Any] = {
                "role": "assistant",
                "content": text,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "reasoning": None,
            }
            choice: dict[str, Any] = {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
                "token_ids": None,
                "routed_experts": None,
            }
            prompt_echo: dict[str, Any] = {
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "prompt_text": None,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
                "token_ids": None,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "routed_experts": None,
            }
            prompt_echo = {}  # completions echo the prompt inside the choice
        return {
            **head,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": usage(prompt_tokens, completion_tokens, False, self._details(cache, stream=False)),
            **prompt_echo,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }

    def _details(self, cache: PromptCache | None, stream: bool) -> dict[str, Any] | None:
        return None if cache is None else prompt_tokens_details(cache, self.chat, stream)

    def role_chunk(self) -> dict[str, Any]:
        """Chat streams open with the role, sent together with the first output."""
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return {**self._head(stream=True), "choices": [choice], "prompt_token_ids": None, "prompt_text": None}

    def token_chunk(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "delta": {"content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            if finish_reason is not None:
                choice["stop_reason"] = None
            choice["token_ids"] = None
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
                "prompt_token_ids": None,
                "token_ids": None,
            }
        return {**self._head(stream=True), "choices": [choice]}

    def usage_chunk(
        self, prompt_tokens: int, completion_tokens: int, cache: PromptCache | None = None
    ) -> dict[str, Any]:
        return {
            **self._head(stream=True),
            "choices": [],
            "usage": usage(prompt_tokens, completion_tokens, True, self._details(cache, stream=True)),
            "system_fingerprint": SYSTEM_FINGERPRINT,
        }


def model_card(
    model: str, root: str, max_model_len: int | None, created: int, parent: str | None = None
) -> dict[str, Any]:
    permission = {
        "id": "modelperm-" + uuid.uuid4().hex[:16],
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    return {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [permission],
    }
