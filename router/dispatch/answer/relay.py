"""Relay: an answer's stream passed to the client chunk by chunk, whole events at a time; and a whole answer
too long to hold, passed on as it arrives.

A stream that breaks ends with an error event and [DONE] rather than a cut connection; an engine's own error
event counts against its instance; shutting down ends every stream still relayed the same way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable

import aiohttp
import msgspec

from router.dispatch.answer.sse import EventFramer
from router.dispatch.observe.cached_tokens import stream_cached_tokens, with_cached_tokens
from router.dispatch.observe.outcome import Outcome
from router.dispatch.observe.usage import tail_usage
from router.dispatch.place.sending import READ_PART_BYTES
from router.errors import anthropic_error_json, error_json, error_object
from router.metrics import RouterMetrics

log = logging.getLogger(__name__)
_encode = msgspec.json.Encoder().encode

# How vLLM reports a failure after a stream began; inside a JSON string a quote is escaped, so no generated
# text can look like it.
_ERROR_EVENT = b'data: {"error"'


# The event that ends a stream, by API: a client that has it may close the connection before the engine's own
# end reaches the router (Codex does, at response.completed), and has still had all of its answer.
_LAST_EVENT = {
    "chat": b"data: [DONE]",
    "completions": b"data: [DONE]",
    "responses": b"event: response.completed",
    "messages": b"event: message_stop",
}

# Of a whole answer relayed as it arrives, the last bytes kept to read its usage from.
_TAIL_BYTES = 64 * 2**10


class RelayBroken(Exception):
    """A whole answer relayed as it arrived broke off: its client must see it cut (its connection closed),
    not a body that looks complete."""


class Relay:
    def __init__(self, metrics: RouterMetrics, idle_timeout_s: float, response_timeout_s: float) -> None:
        """idle_timeout_s: the longest an engine may leave a stream without a chunk; response_timeout_s: the
        longest a whole answer may take, from its sending to its last byte."""
        self._metrics, self._idle_timeout_s = metrics, idle_timeout_s
        self._response_timeout_s = response_timeout_s
        self._streams: set[Outcome] = set()  # being relayed to clients
        self.closing = False  # shutting down: streams still starting end at once

    async def stream(self, outcome: Outcome, ended: Callable[[Outcome], None]) -> AsyncGenerator[bytes, None]:
        """Pass SSE chunks through as they arrive; ended(outcome) once the stream is over, however it ends."""
        upstream = outcome.upstream
        assert isinstance(upstream, aiohttp.ClientResponse)
        content, idle_s = upstream.content, self._idle_timeout_s
        events = EventFramer()  # a break mid-event drops the half event before the error event
        self._streams.add(outcome)
        cached = outcome.prefill_cached_tokens
        try:
            if whole := events.whole(outcome.first):
                yield self._passed(outcome, whole, cached)
            if self.closing:  # its first chunk came after end_streams
                outcome.cut_off()
                upstream.close()
            while True:
                async with asyncio.timeout(idle_s):
                    chunk = await content.readany()
                if not chunk:
                    if outcome.cut:  # closed under the read, which saw an end rather than an error
                        raise aiohttp.ClientConnectionError("ended by the router")
                    if events.unfinished():  # closed mid-event: a body ended by its connection's close
                        raise aiohttp.ClientPayloadError("the stream ended in the middle of an event")
                    outcome.complete()
                    return
                if whole := events.whole(chunk):
                    yield self._passed(outcome, whole, cached)
        except (TimeoutError, aiohttp.ClientError) as exc:
            outcome.broke()
            if events.cut_open:  # part of an event too long to hold went out: ended, it is not glued to ours
                yield b"\n\n"
            if outcome.cut:
                message, code = "the router is shutting down; the stream was ended early", "shutting_down"
            else:
                log.warning("stream from %s broke: %r", outcome.instance.name, exc)
                kind = "stream_idle" if isinstance(exc, TimeoutError) else "stream"
                self._metrics.upstream_errors(outcome.instance.name, kind).inc()
                message = f"the upstream instance failed mid-stream: {type(exc).__name__}"
                code = "stream_broken"
            yield stream_error(message, code, outcome.api)
        finally:
            self._streams.discard(outcome)
            ended(outcome)

    async def whole(self, outcome: Outcome, ended: Callable[[Outcome], None]) -> AsyncGenerator[bytes, None]:
        """A whole answer longer than what is held (router/dispatch/place/sending.py WHOLE_HELD_BYTES), passed
        on as it arrives within response_timeout_s of its sending; its usage read from its last bytes. One
        that breaks off raises RelayBroken; ended(outcome) once it is over, however it ends."""
        upstream = outcome.upstream
        assert isinstance(upstream, aiohttp.ClientResponse)
        loop, content = asyncio.get_running_loop(), upstream.content
        deadline = loop.time() + self._response_timeout_s - (outcome.observers.clock() - outcome.started)
        tail = outcome.first[-_TAIL_BYTES:]
        self._streams.add(outcome)
        try:
            yield outcome.first
            while True:
                async with asyncio.timeout_at(deadline):
                    part = await content.read(READ_PART_BYTES)  # not readany: bounded parts
                if not part:
                    if outcome.cut:
                        raise aiohttp.ClientConnectionError("ended by the router")
                    outcome.completed_with(tail_usage(tail))
                    return
                tail = (tail + part)[-_TAIL_BYTES:] if len(part) < _TAIL_BYTES else part[-_TAIL_BYTES:]
                yield part
        except (TimeoutError, aiohttp.ClientError) as exc:
            outcome.broke()
            if not outcome.cut:
                log.warning("a whole answer from %s broke off: %r", outcome.instance.name, exc)
                kind = "timeout" if isinstance(exc, TimeoutError) else "response"
                self._metrics.upstream_errors(outcome.instance.name, kind).inc()
            raise RelayBroken from exc
        finally:
            self._streams.discard(outcome)
            ended(outcome)

    def end_streams(self) -> None:
        """Shutting down: end every stream still relayed with an error event and [DONE], now, rather than
        have the server cut the connections without notice."""
        self.closing = True
        for outcome in list(self._streams):
            outcome.cut_off()
            if outcome.upstream is not None:
                outcome.upstream.close()  # the relay's read fails at once; the engine aborts the request

    def _passed(self, outcome: Outcome, events: bytes, cached: int | None) -> bytes:
        """Whole events as the client gets them: a disaggregated answer's cached tokens as the prefill leg
        found them; its error event and its usage chunk's cached tokens told to the outcome."""
        self._watch_errors(outcome, events)
        if outcome.watch is not None:
            outcome.watch(events)
        last = _LAST_EVENT.get(outcome.api)
        if last is not None and last in events:
            outcome.complete()
        if cached is not None:
            events = with_cached_tokens(events, cached)
        if (reported := stream_cached_tokens(events, outcome.api)) is not None:
            outcome.observed_cache(*reported)
        return events

    def _watch_errors(self, outcome: Outcome, events: bytes) -> None:
        """An engine failure the stream reports (its error event) counts against the instance."""
        if _ERROR_EVENT in events and not outcome.engine_error and _server_error_event(events):
            outcome.engine_failed()
            self._metrics.upstream_errors(outcome.instance.name, "stream_error").inc()


def sse_error(message: str, code: str = "stream_broken") -> bytes:
    return b"data: " + error_json(message, "upstream_error", code) + b"\n\n"


def stream_error(message: str, code: str, api: str) -> bytes:
    """The events that end a stream the router cuts, in its API's terms: OpenAI's error chunk and [DONE];
    a Responses `error` event; Anthropic's `error` event (neither of those has a [DONE])."""
    if api == "responses":
        error = {"type": "error", "code": code, "message": message, "param": None}
        return b"event: error\ndata: " + _encode(error) + b"\n\n"
    if api == "messages":
        return b"event: error\ndata: " + anthropic_error_json(message, "api_error") + b"\n\n"
    return sse_error(message, code) + b"data: [DONE]\n\n"


def _server_error_event(events: bytes) -> bool:
    """Whether the first error event in events is the engine's failure (its code 5xx, or none), not a
    refusal of the client's request (4xx), which says nothing against the instance."""
    start = events.index(_ERROR_EVENT) + len(b"data: ")
    end = events.find(b"\n", start)
    try:
        code = error_object(events[start : end if end >= 0 else None]).get("code")
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return True
    return not (isinstance(code, int) and 400 <= code < 500)
