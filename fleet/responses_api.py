"""The Responses API of one simulated instance, as vLLM 0.32 serves it for a non-harmony model:
``POST /v1/responses`` (a stream of events or the whole response; in the background when asked),
``GET /v1/responses/{id}`` (``stream=true&starting_after=N`` follows a background stream) and
``POST /v1/responses/{id}/cancel``.

The prompt is the chat ``router.apis.responses.chat`` builds from the body (and, with
``previous_response_id``, from the stored previous response), tokenized with special tokens as vLLM does;
it runs on the instance's engine like any chat, so the usage's cached tokens are the engine's prefix hits.
The body's ``request_id`` is the response's id (else ``resp_`` and 16 hex digits).

Added by fleet/launcher.py to fleet/server.py's app.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from fleet.agent_requests import BodyValidationError, read_json_body
from fleet.response_store import ResponseStore
from fleet.responses_objects import ResponseEcho, TextEvents, new_id, output_message, usage
from fleet.server import ClientError, Generation, SimInstance, check_model, error_response, json_response
from router.apis.openai_body import lax_bool
from router.apis.responses.chat import ResponsesChat, responses_chat
from router.prompt.chat_conversation import InvalidPrompt
from router.prompt.multimodal.block_keys import Placed
from router.prompt.template_inputs import TemplateInputs

_json = msgspec.json.Encoder()
_BOOLEANS = ("stream", "background", "store")
_RESPONSE_ID = "response_id"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def add_responses_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", _answering_errors(_create))
    app.router.add_get("/v1/responses/{response_id}", _answering_errors(_retrieve))
    app.router.add_post("/v1/responses/{response_id}/cancel", _answering_errors(_cancel))

    async def stop_background_runs(app: web.Application) -> None:
        await app["instance"].responses.close()

    app.on_cleanup.append(stop_background_runs)


def _answering_errors(handle: Handler) -> Handler:
    async def answer(request: web.Request) -> web.StreamResponse:
        try:
            return await handle(request)
        except ClientError as exc:
            return error_response(exc.status, exc.message, exc.kind, exc.param)
        except InvalidPrompt as exc:
            return error_response(400, str(exc), "BadRequestError")

    return answer


def _not_found(response_id: str) -> ClientError:
    message = f"Response with id '{response_id}' not found."
    return ClientError(404, message, "invalid_request_error", _RESPONSE_ID)


@dataclass
class _Run:
    """One response being generated: its engine request and what its copies repeat of the request."""

    generation: Generation
    echo: ResponseEcho
    store: ResponseStore | None  # where it is kept when it ends; None: not stored

    async def whole(self) -> dict[str, Any]:
        output = [token async for token in self.generation.tokens()]
        text = self.generation.instance.tokenizer.decode(output)
        return self._ended([output_message(new_id("msg_"), text, "completed")], len(output))

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """The event stream of the response, response.created to response.completed."""
        events, token_text = TextEvents(), self.generation.instance.tokenizer.token_text
        started = self.echo.body("in_progress", [], None)
        yield events.lifecycle("response.created", started)
        yield events.lifecycle("response.in_progress", started)
        count = 0
        async for token in self.generation.tokens():
            if count == 0:
                for event in events.opened():
                    yield event
            count += 1
            yield events.delta(token_text(token))
        output = []
        if count:
            closing = events.closed()
            for event in closing:
                yield event
            output = [closing[-1]["item"]]  # response.output_item.done's
        yield events.lifecycle("response.completed", self._ended(output, count))

    def _ended(self, output: list[dict[str, Any]], count: int) -> dict[str, Any]:
        generation = self.generation
        status = "incomplete" if count >= generation.max_tokens else "completed"
        spent = usage(len(generation.prompt_ids), count, generation.prompt_cache())
        response = self.echo.body(status, output, spent, generation.kept_for_decode())
        if self.store is not None:
            self.store.put(response)
        return response


async def _create(request: web.Request) -> web.StreamResponse:
    instance: SimInstance = request.app["instance"]
    body = await read_json_body(request, ("input",), _BOOLEANS, _tool_choice_none_without_tools)
    _check_fields(body)
    check_model(instance, body)
    store = instance.responses
    if body.get("background") and body.get("store", True) and not store.enabled:
        raise ClientError(
            400,
            "This vLLM engine does not support `store=True` and therefore does not support the background "
            "mode. To enable these features, set the environment variable "
            "`VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.",
            "invalid_request_error",
            "background",
        )
    kept = store.enabled and body.get("store", True) is not False  # otherwise silently not stored
    run = await _run(request, instance, body, kept)
    if body.get("background"):
        return await _in_background(request, run, store, bool(body.get("stream")))
    if body.get("stream"):
        return await _sse(request, run.events())
    return json_response(await run.whole())


def _tool_choice_none_without_tools(body: dict[str, Any]) -> None:
    """vLLM's request model reads "auto" (the default) and "none" as "none" when there are no tools."""
    if not body.get("tools") and body.get("tool_choice", "auto") in ("auto", "none"):
        body["tool_choice"] = "none"


def _check_fields(body: dict[str, Any]) -> None:
    """What vLLM's request model refuses before the handler runs."""
    if body.get("background") and body.get("store", True) is False:
        raise ClientError(
            400,
            "background can only be used when `store` is true (parameter=background)",
            "BadRequestError",
            "background",
        )
    if body.get("prompt") is not None:
        raise ClientError(
            400, "prompt template is not supported (parameter=prompt)", "BadRequestError", "prompt"
        )
    if not body.get("tools") and body.get("tool_choice") == "required":
        message = "Tool choice 'required' must be specified with 'tools' parameter. (parameter=tool_choice)"
        raise ClientError(400, message, "BadRequestError", "tool_choice")


async def _run(request: web.Request, instance: SimInstance, body: dict[str, Any], kept: bool) -> _Run:
    """The response's prompt rendered and checked, its engine request made; its messages kept when stored."""
    store = instance.responses
    previous_messages: list[dict[str, Any]] = []
    previous_output: list[Any] = []
    previous_id = body.get("previous_response_id")
    if previous_id is not None:
        previous = store.response(str(previous_id)) if store.enabled else None
        if previous is None:
            raise _not_found(str(previous_id))
        previous_messages = store.messages(str(previous_id)) or []
        previous_output = previous["output"]
    elif body["input"] == [] and not body.get("instructions"):
        message = "Cannot apply chat template to an empty conversation. Provide at least one message."
        raise ClientError(400, message, "BadRequestError")

    def rendered() -> tuple[ResponsesChat, tuple[list[int], list[Placed]]]:
        chat = responses_chat(
            body, previous_messages, previous_output, instance.exclude_tools_when_tool_choice_none
        )
        try:
            return chat, (chat.token_ids(instance.tokenizer), [])
        except InvalidPrompt:  # its images, where the model's are laid out as vLLM lays them out
            if instance.tokenizer.image_layout is None:
                raise
        flags = (chat.add_generation_prompt, chat.continue_final_message, True)
        inputs = TemplateInputs(chat.tools, chat.template_kwargs, calls_as_given=True)
        return chat, instance.tokenizer.chat_with_images(instance.root, chat.messages, flags, inputs)

    chat, (ids, images) = await instance.off_loop(rendered)
    generation = _generation(request, instance, body, ids)
    generation.images = images
    response_id = str(body.get("request_id") or new_id("resp_"))
    echo = ResponseEcho(response_id, int(time.time()), body["model"], body, generation.max_tokens)
    if kept:
        store.put_messages(response_id, chat.messages)
    return _Run(generation, echo, store if kept else None)


def _generation(
    request: web.Request, instance: SimInstance, body: dict[str, Any], ids: list[int]
) -> Generation:
    """The engine request, its output budget max_output_tokens (vLLM names it so in its errors)."""
    chat_like = {k: v for k, v in body.items() if k not in ("max_tokens", "max_completion_tokens", "n")}
    chat_like["max_tokens"] = body.get("max_output_tokens")
    try:
        return Generation(request, instance, chat_like, ids, chat=True, from_text=True)
    except ClientError as exc:
        if exc.param != "max_tokens":
            raise
        message = exc.message.replace("max_tokens", "max_output_tokens")
        raise ClientError(exc.status, message, exc.kind, "max_output_tokens") from exc


async def _in_background(
    request: web.Request, run: _Run, store: ResponseStore, stream: bool
) -> web.StreamResponse:
    """Queued and stored at once, then generated by a task of its own; a stream follows its events."""
    queued = run.echo.body("queued", [], None)
    store.put(queued)
    response_id = run.echo.id
    if not stream:
        store.run_in_background(response_id, asyncio.create_task(_ending(run.whole(), store, response_id)))
        return json_response(queued)
    log = store.start_events(response_id)

    async def record() -> None:
        try:
            async for event in run.events():
                log.append(event)
        finally:
            log.end()

    store.run_in_background(response_id, asyncio.create_task(_ending(record(), store, response_id)))
    return await _sse(request, log.follow(0))


async def _ending(work: Awaitable[Any], store: ResponseStore, response_id: str) -> None:
    """A background run; one that fails leaves its stored response "failed", as vLLM marks it."""
    try:
        await work
    except Exception:
        stored = store.response(response_id)
        if stored is not None and stored["status"] not in ("completed", "cancelled"):
            stored["status"] = "failed"


async def _sse(request: web.Request, events: AsyncIterator[dict[str, Any]]) -> web.StreamResponse:
    """Events framed as vLLM frames them: an event line and a data line each, no [DONE] at the end."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await response.prepare(request)
    async for event in events:
        await response.write(
            b"event: " + event["type"].encode() + b"\ndata: " + _json.encode(event) + b"\n\n"
        )
    await response.write_eof()
    return response


async def _retrieve(request: web.Request) -> web.StreamResponse:
    instance: SimInstance = request.app["instance"]
    response_id = request.match_info[_RESPONSE_ID]
    starting_after = _query_int(request, "starting_after")
    stream = _query_bool(request, "stream")
    response = instance.responses.response(response_id)
    if response is None:
        raise _not_found(response_id)
    if not stream:
        return json_response(response)
    log = instance.responses.events(response_id)
    if log is None:
        return await _broken_stream(request)
    return await _sse(request, log.follow(0 if starting_after is None else starting_after + 1))


async def _broken_stream(request: web.Request) -> web.StreamResponse:
    """vLLM's answer to following a response that was not streamed in the background: its event generator
    fails once the 200 is sent, so the connection closes before the stream's end."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await response.prepare(request)
    if request.transport is not None:
        request.transport.close()
    return response


def _query_int(request: web.Request, name: str) -> int | None:
    raw = request.query.get(name)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        error = {
            "type": "int_parsing",
            "loc": f"query.{name}",
            "msg": "Input should be a valid integer, unable to parse string as an integer",
            "input": raw,
        }
        raise BodyValidationError([str(error)], f"query.{name}") from None


def _query_bool(request: web.Request, name: str) -> bool:
    raw = request.query.get(name)
    if raw is None:
        return False
    read = lax_bool(raw)
    if read is None:
        error = {"type": "bool_parsing", "loc": f"query.{name}", "msg": "Input should be a valid boolean"}
        raise BodyValidationError([str({**error, "input": raw})], f"query.{name}")
    return read


async def _cancel(request: web.Request) -> web.StreamResponse:
    store: ResponseStore = request.app["instance"].responses
    response_id = request.match_info[_RESPONSE_ID]
    response = store.response(response_id)
    if response is None:
        raise _not_found(response_id)
    if response["status"] not in ("queued", "in_progress"):
        message = "Cannot cancel a synchronous response."
        raise ClientError(400, message, "invalid_request_error", _RESPONSE_ID)
    response["status"] = "cancelled"
    await store.cancel(response_id)
    return json_response(response)
