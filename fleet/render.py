"""vLLM's render endpoints (served with ``--enable-scale-out``): a request's prompt as the engine's token ids.

``POST /v1/chat/completions/render`` answers one ``GenerateRequest``; ``POST /v1/completions/render`` a
list of them (one per prompt). Routers that key on tokens without a tokenizer of their own (vllm-router's
``cache_aware`` and ``kv_aware``) call these before every decision. Bodies are laid out as vLLM 0.32's
``GenerateRequest.model_dump()``; ``sampling_params`` omits defaults as its msgspec struct does.

Added by fleet/launcher.py to fleet/server.py's app, whose request handling (validation, tokenization,
errors) it reuses.
"""

from __future__ import annotations

import uuid
from typing import Any

from aiohttp import web

from fleet.server import (
    ClientError,
    SimInstance,
    handler,
    json_response,
    max_tokens_for,
    validated_chat,
    validated_completion,
)

CHAT_PATH = "/v1/chat/completions/render"
COMPLETION_PATH = "/v1/completions/render"

_STREAM, _FINAL_ONLY = 1, 2  # vLLM's RequestOutputKind.DELTA and FINAL_ONLY
_DEFAULT_MAX_TOKENS = 16  # SamplingParams' default, so omitted from the dump


def add_render_routes(app: web.Application) -> None:
    app.router.add_post(CHAT_PATH, handler(_render_chat))
    app.router.add_post(COMPLETION_PATH, handler(_render_completion))


async def _render_chat(instance: SimInstance, request: web.Request, body: dict[str, Any]) -> web.Response:
    ids = await instance.off_loop(validated_chat, instance, body)
    request_id = "chatcmpl-" + _base_id(request, body)
    return json_response(_generate_request(instance, body, ids, request_id, chat=True, from_text=True))


async def _render_completion(
    instance: SimInstance, request: web.Request, body: dict[str, Any]
) -> web.Response:
    ids, from_text = await instance.off_loop(validated_completion, instance, body)
    request_id = "cmpl-" + _base_id(request, body)
    rendered = _generate_request(instance, body, ids, request_id, chat=False, from_text=from_text)
    return json_response([rendered])


def _base_id(request: web.Request, body: dict[str, Any]) -> str:
    """vLLM's order: the X-Request-Id header, the body's request_id, a random uuid."""
    given = request.headers.get("X-Request-Id") or body.get("request_id")
    return str(given) if given else uuid.uuid4().hex[:16]


def _generate_request(
    instance: SimInstance, body: dict[str, Any], ids: list[int], request_id: str, chat: bool, from_text: bool
) -> dict[str, Any]:
    if not ids:
        raise ClientError(400, "No token_ids rendered", "BadRequestError")
    max_tokens = max_tokens_for(
        instance.max_model_len, body, len(ids), chat, from_text, instance.max_new_tokens
    )
    stream = bool(body.get("stream"))
    return {
        "request_id": request_id,
        "token_ids": ids,
        "token_offsets": None,
        "features": None,
        "content_parts": None,
        "sampling_params": _sampling_params(body, max_tokens, stream),
        "model": body.get("model"),
        "reasoning_ended": None,
        "reasoning_parser_kwargs": None,
        "return_token_ids": None,
        "output_mode": "tokens",
        "stream": stream,
        "stream_options": _stream_options(body) if stream else None,
        "cache_salt": body.get("cache_salt"),
        "priority": body.get("priority", 0),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }


def _sampling_params(body: dict[str, Any], max_tokens: int, stream: bool) -> dict[str, Any]:
    temperature = float(body.get("temperature", 1.0))
    params: dict[str, Any] = {
        "presence_penalty": float(body.get("presence_penalty", 0.0)),
        "frequency_penalty": float(body.get("frequency_penalty", 0.0)),
        "repetition_penalty": float(body.get("repetition_penalty", 1.0)),
        "temperature": temperature,
    }
    if temperature > 0:  # greedy sampling resets top_p and min_p to their defaults, so they drop out
        params.update(top_p=float(body.get("top_p", 1.0)), min_p=float(body.get("min_p", 0.0)))
    if body.get("seed") is not None:
        params["seed"] = body["seed"]
    stop = body.get("stop") or []
    params.update(stop=[stop] if isinstance(stop, str) else list(stop), stop_token_ids=[])
    if max_tokens != _DEFAULT_MAX_TOKENS:
        params["max_tokens"] = max_tokens
    params.update(
        output_kind=_STREAM if stream else _FINAL_ONLY,
        skip_clone=True,
        bad_words=[],
        skip_reading_prefix_cache=False,
    )
    return params


def _stream_options(body: dict[str, Any]) -> dict[str, Any] | None:
    options = body.get("stream_options")
    if not isinstance(options, dict):
        return None
    return {
        "include_usage": options.get("include_usage", False),
        "continuous_usage_stats": options.get("continuous_usage_stats", False),
    }
