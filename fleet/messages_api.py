"""The Anthropic Messages API of one simulated instance, as vLLM 0.32 serves it: ``POST /v1/messages`` (a
stream of events or the whole message) and ``POST /v1/messages/count_tokens``.

As in vLLM, the body becomes a chat completions request (``router.apis.messages.chat``), served as the
instance's chats are (the same token ids, checks and engine accounting), and the answer is laid out in
Anthropic's shape as vLLM's ``AnthropicServingMessages`` builds it: the chat's id (``chatcmpl-...``), one text
block, ``stop_reason`` mapped from the finish reason, the cache fields of the usage only with
--enable-prompt-tokens-details; a stream is message_start, content_block_start/delta/stop, message_delta and
message_stop (no ping, no [DONE]). Errors are ``{"type":"error","error":{"type","message"}}``, but those of
the body's validation, which vLLM leaves in OpenAI's shape.

Added by fleet/launcher.py to fleet/server.py's app.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from fleet.agent_requests import BodyValidationError, read_json_body
from fleet.engine import PromptCache
from fleet.server import (
    ClientError,
    Generation,
    SimInstance,
    error_response,
    json_response,
    validated_chat_with_images,
)
from router.apis.messages.chat import anthropic_chat_body, template_probes
from router.prompt.chat_conversation import InvalidPrompt
from router.prompt.multimodal.block_keys import Placed

_json = msgspec.json.Encoder()
# What the engine request takes from the Anthropic body beside the converted chat
_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "stop_sequences": "stop"}
_PASSED = ("kv_transfer_params", "seed")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def add_messages_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", _anthropic_errors(_messages))
    app.router.add_post("/v1/messages/count_tokens", _anthropic_errors(_count_tokens))


def anthropic_error(status: int, message: str, kind: str) -> web.Response:
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return web.Response(status=status, body=_json.encode(body), content_type="application/json")


def _anthropic_errors(handle: Handler) -> Handler:
    async def answer(request: web.Request) -> web.StreamResponse:
        try:
            return await handle(request)
        except BodyValidationError as exc:
            return error_response(exc.status, exc.message, exc.kind, exc.param)
        except ClientError as exc:
            return anthropic_error(exc.status, exc.message, exc.kind)
        except InvalidPrompt as exc:
            return anthropic_error(400, str(exc), "BadRequestError")

    return answer


def _chat(
    instance: SimInstance, body: dict[str, Any]
) -> tuple[dict[str, Any], tuple[list[int], list[Placed]]]:
    """The chat vLLM converts the body to, and its prompt's token ids (and images placed in them) after the
    chat path's checks."""
    chat = anthropic_chat_body(body, template_probes(instance.tokenizer))
    chat.setdefault("model", body.get("model"))
    for name, chat_name in _SAMPLING.items():
        if body.get(name) is not None:
            chat[chat_name] = body[name]
    chat.update({name: body[name] for name in _PASSED if body.get(name) is not None})
    return chat, validated_chat_with_images(instance, chat)


async def _count_tokens(request: web.Request) -> web.StreamResponse:
    instance: SimInstance = request.app["instance"]
    body = await read_json_body(request, ("model", "messages"))
    _, (ids, _) = await instance.off_loop(_chat, instance, body)
    return json_response(
        {"input_tokens": len(ids), "context_management": {"original_input_tokens": len(ids)}}
    )


async def _messages(request: web.Request) -> web.StreamResponse:
    instance: SimInstance = request.app["instance"]
    body = await read_json_body(request, ("model", "messages", "max_tokens"), ("stream",))
    max_tokens = body["max_tokens"]
    if type(max_tokens) is not int or max_tokens <= 0:
        error = {
            "type": "value_error",
            "loc": "body.max_tokens",
            "msg": "Value error, max_tokens must be positive",
        }
        raise BodyValidationError([str({**error, "input": max_tokens})], "body.max_tokens")
    chat, (ids, images) = await instance.off_loop(_chat, instance, body)
    generation = Generation(request, instance, chat, ids, chat=True, from_text=True)
    generation.images = images
    if body.get("stream"):
        return await _stream(request, generation)
    output = [token async for token in generation.tokens()]
    text = instance.tokenizer.decode(output)
    message: dict[str, Any] = {
        "id": generation.envelope.id,
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": text}],  # an empty answer too has its one text block
        "model": generation.envelope.model,
        "stop_reason": _stop_reason(generation, len(output)),
        "usage": _usage(len(ids), len(output), generation.reported_cache()),
    }
    if (kept := generation.kept_for_decode()) is not None:
        message["kv_transfer_params"] = kept
    return json_response(message)


def _stop_reason(generation: Generation, count: int) -> str:
    return "max_tokens" if count >= generation.max_tokens else "end_turn"


def _usage(prompt_tokens: int, output_tokens: int, cache: PromptCache | None) -> dict[str, Any]:
    """Anthropic counts the prompt's cached and newly cached tokens apart from its input tokens."""
    if cache is None:
        return {"input_tokens": prompt_tokens, "output_tokens": output_tokens}
    return {
        "input_tokens": max(0, prompt_tokens - cache.cached_tokens - cache.created_tokens),
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": cache.created_tokens,
        "cache_read_input_tokens": cache.cached_tokens,
    }


def _event(kind: str, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _json.encode({"type": kind, **fields}) + b"\n\n"


async def _stream(request: web.Request, generation: Generation) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await response.prepare(request)
    envelope, token_text = generation.envelope, generation.instance.tokenizer.token_text
    prompt_tokens = len(generation.prompt_ids)
    message: dict[str, Any] = {
        "id": envelope.id,
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": envelope.model,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},  # the first chunk's: no cache fields
    }
    count = 0
    async for token in generation.tokens():
        if count == 0:  # vLLM starts the message with the chat's first chunk, sent with the first token
            await response.write(_event("message_start", message=message))
            block = {"type": "text", "text": ""}
            await response.write(_event("content_block_start", content_block=block, index=0))
        count += 1
        delta = {"type": "text_delta", "text": token_text(token)}
        await response.write(_event("content_block_delta", delta=delta, index=0))
    await response.write(
        _event("content_block_stop", index=0) if count else _event("message_start", message=message)
    )
    stop = {"stop_reason": _stop_reason(generation, count), "stop_sequence": None}
    spent = _usage(prompt_tokens, count, generation.reported_cache())
    await response.write(_event("message_delta", delta=stop, usage=spent))
    await response.write(_event("message_stop"))
    await response.write_eof()
    return response
