"""Relay: an answer's stream passed to the client chunk by chunk, whole events at a time.

A stream that breaks ends with an error event and [DONE] rather than a cut connection; an engine's own error
event counts against its instance; shutting down ends every stream still relayed the same way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable

import aiohttp
import msgspec

from router.dispatch.cached_tokens import stream_cached_tokens, with_cached_tokens
from router.dispatch.outcome import Outcome
from router.dispatch.sse import EventFramer
from router.errors import error_json, error_object
from router.metrics import RouterMetrics

log = logging.getLogger(__name__)

# How vLLM reports a failure after a stream began; inside a JSON string a quote is escaped, so no generated
# text can look like it.
_ERROR_EVENT = b'data: {"error"'


class Relay:
    def __init__(self, metrics: RouterMetrics, idle_timeout_s: float) -> None:
        """idle_timeout_s: the longest an engine may leave a stream without a chunk."""
        self._metrics, self._idle_timeout_s = metrics, idle_timeout_s
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
                    if rest := events.rest():
                        yield rest
                    outcome.complete()
                    return
                if whole := events.whole(chunk):
                    yield self._passed(outcome, whole, cached)
        except (TimeoutError, aiohttp.ClientError) as exc:
            outcome.broke()
            if outcome.cut:
                yield sse_error("the router is shutting down; the stream was ended early", "shutting_down")
            else:
                log.warning("stream from %s broke: %r", outcome.instance.name, exc)
                kind = "stream_idle" if isinstance(exc, TimeoutError) else "stream"
                self._metrics.upstream_errors(outcome.instance.name, kind).inc()
                yield sse_error(f"the upstream instance failed mid-stream: {type(exc).__name__}")
            yield b"data: [DONE]\n\n"
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
        if cached is not None:
            events = with_cached_tokens(events, cached)
        if (reported := stream_cached_tokens(events)) is not None:
            outcome.observed_cache(*reported)
        return events

    def _watch_errors(self, outcome: Outcome, events: bytes) -> None:
        """An engine failure the stream reports (its error event) counts against the instance."""
        if _ERROR_EVENT in events and not outcome.engine_error and _server_error_event(events):
            outcome.engine_failed()
            self._metrics.upstream_errors(outcome.instance.name, "stream_error").inc()


def sse_error(message: str, code: str = "stream_broken") -> bytes:
    return b"data: " + error_json(message, "upstream_error", code) + b"\n\n"


def _server_error_event(events: bytes) -> bool:
    """Whether the first error event in events is the engine's failure (its code 5xx, or none), not a
    refusal of the client's request (4xx), which says nothing against the instance."""
    start = events.index(_ERROR_EVENT) + len(b"data: ")
    end = events.find(b"\n", start)
    try:
        code = error_object(events[start : end if end >= 0 else None]).get("code")
    except (msgspec.DecodeError, RecursionError):
        return True
    return not (isinstance(code, int) and 400 <= code < 500)
