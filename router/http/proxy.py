"""kvroute serve's front door: a request's body read within its limits, routed by the routing service
(router/dispatch/conductor.py), and the answer made for the client: a stream relayed event by event
(router/dispatch/answer/relay.py), a whole answer in one piece. What became of it is told by its outcome
(router/dispatch/observe/outcome.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from router.apis.routes import Api
from router.dispatch.answer.relay import Relay
from router.dispatch.conductor import Conductor
from router.dispatch.context import Arrival, Received
from router.dispatch.decide.decision import Prepared
from router.dispatch.observe.cached_tokens import with_cached_tokens
from router.dispatch.observe.outcome import Outcome
from router.dispatch.observe.routing_headers import routing_headers
from router.dispatch.place.sending import streams_events
from router.errors import (
    RETRY_AFTER_S,
    OpenAIError,
    anthropic_error_json,
    anthropic_error_type,
    body_timeout,
    client_closed,
    error_json,
    error_object,
    unavailable,
)
from router.http.body_budget import BodyBudget
from router.http.client_watch import ClientWatch
from router.http.relay_response import Head, RelayResponse
from router.metrics import RouterMetrics
from router.tracing.spans import Trace

log = logging.getLogger(__name__)

# Of an engine's answer, what the client gets too: the engine's id for the request (vLLM's
# --enable-request-id-headers) and, on an error, when to come back (an engine, or a gateway in front of it).
_PASSED_ON = frozenset({b"x-request-id"})
_PASSED_ON_ERRORS = _PASSED_ON | {b"retry-after"}
_MAX_ERROR_TEXT = 500  # characters of a non-JSON upstream error kept in the message


@dataclass(frozen=True)
class BodyLimits:
    max_body_bytes: Callable[[], int]  # the largest body, read at each request (a reload applies)
    body_timeout_s: float = 60.0  # the longest a client may take to send its body
    send_timeout_s: float = 60.0  # to take a stream's next chunk


class Proxy:
    def __init__(
        self,
        routing: Conductor,
        relay: Relay,
        metrics: RouterMetrics,
        limits: BodyLimits,
        bodies: BodyBudget,
    ) -> None:
        self._routing, self._relay, self._metrics, self._limits = routing, relay, metrics, limits
        self._bodies = bodies
        self._starting: set[asyncio.Task[object]] = set()  # requests not yet answered nor streaming
        self._ended: set[asyncio.Task[object]] = set()  # of those, the ones end_streams cancelled

    async def forward(self, request: Request, path: str, api: Api, stored: str | None = None) -> Response:
        """The answer, or an OpenAIError; one still being routed or computed when the router shuts down is a
        503 the client may retry (the engine aborts it), not the server's plain-text 500. stored: the stored
        response the path names."""
        task = asyncio.current_task()
        assert task is not None
        if self._relay.closing:
            raise _shutting_down()
        self._starting.add(task)
        try:
            return await self._forward(request, path, api, stored)
        except asyncio.CancelledError:
            if task not in self._ended:
                raise
            task.uncancel()
            raise _shutting_down() from None
        finally:
            self._starting.discard(task)
            self._ended.discard(task)

    def end_streams(self) -> None:
        """Shutting down: every stream still relayed ends with an error event and [DONE], and every request
        waiting for a first byte, a whole answer or a slot gets a 503 it may retry."""
        self._relay.end_streams()
        for task in self._starting - self._ended:
            self._ended.add(task)
            task.cancel()

    async def _forward(self, request: Request, path: str, api: Api, stored: str | None) -> Response:
        headers = _first_values(request)
        trace = self._routing.trace(request.method, path, stored, headers)
        try:
            return await self._traced(request, headers, path, api, stored, trace)
        except BaseException as error:
            trace.failed(error)
            trace.end()
            raise

    async def _traced(
        self, request: Request, headers: dict[str, str], path: str, api: Api, stored: str | None, trace: Trace
    ) -> Response:
        """The answer to the request whose root span is trace, which ends with it."""
        with trace.step("receive"):
            raw, share = await self._read_body(request, headers.get("content-length"))
        query = request.scope["query_string"].decode("latin-1")  # not request.url: built for each request
        if query:  # a retrieval's stream and starting_after, Claude Code's ?beta=true: the engine's too
            path = f"{path}?{query}"
        # From here until the answer begins, a client that leaves cancels the work: waiting for a slot (an
        # overloaded router's clients time out), routing, or waiting for the engine.
        routing = self._routing

        async def send(received: Received, prepared: Prepared) -> Outcome:
            return await routing.send(received, prepared, path)

        # Once admitted (or refused), its body counts with the work in flight, not against the bodies' budget.
        arrival = Arrival(raw, api, headers, stored, query, trace, lambda: self._bodies.give_back(share))
        with ClientWatch(request.receive) as watch:
            try:
                outcome = await routing.conduct(arrival, send)
            except asyncio.CancelledError:
                if not watch.client_left():
                    raise
                raise client_closed() from None  # counted with the client errors
        try:
            return self._answer(outcome, api.anthropic, trace)
        except BaseException:
            self._ended_here(outcome, trace)  # whatever failed in making the answer, its slot is freed
            raise

    async def _read_body(self, request: Request, declared: str | None) -> tuple[bytes, int]:
        """The body and its share of the body budget (router/http/body_budget.py), read before a slot is
        taken and within a time limit: a client that trickles its body must not hold one of the slots that
        bound the work in flight. declared: its content-length (a number: router/http/request_limits.py
        checked)."""
        limit_s, bodies = self._limits.body_timeout_s, self._bodies
        share = int(declared) if declared is not None else self._limits.max_body_bytes()
        reading = False
        try:
            async with asyncio.timeout(limit_s):
                taken = await bodies.take(share)
                reading = True
                try:
                    return await request.body(), taken
                except BaseException:
                    bodies.give_back(taken)
                    raise
        except ClientDisconnect:  # gone while sending its body
            raise client_closed() from None
        except TimeoutError:
            if reading:
                raise body_timeout(limit_s) from None
            self._metrics.rejected("bodies_budget").inc()  # other bodies held the budget all that time
            raise _bodies_waited(limit_s) from None

    def _answer(self, outcome: Outcome, anthropic: bool, trace: Trace) -> Response:
        """The client's answer to an outcome: relayed as it arrives (a stream; a whole answer too long to
        hold), which ends the outcome (and its trace) when it is over, or in one piece, the outcome ended
        here."""
        upstream = outcome.upstream
        assert isinstance(upstream, aiohttp.ClientResponse)
        content_type = upstream.headers.get("content-type", "application/json")
        status = upstream.status
        headers = _answer_headers(outcome, upstream)
        events = streams_events(upstream)
        if events or (status < 400 and not upstream.content.at_eof()):  # a stream, or more than is held
            if not events and (length := upstream.headers.get("content-length")) is not None:
                headers.append((b"content-length", length.encode()))
            relay = self._relay.stream if events else self._relay.whole
            return RelayResponse(
                relay(outcome, lambda ended: self._ended_here(ended, trace)),
                lambda: self._ended_here(outcome, trace),
                Head(status, headers, content_type),
                self._limits.send_timeout_s,
                lambda: self._stalled(outcome),
            )
        payload = outcome.first
        if outcome.prefill_cached_tokens is not None:
            payload = with_cached_tokens(payload, outcome.prefill_cached_tokens)
        if status >= 400:  # in the API's shape, whatever its content type said
            payload, content_type = _error_body(payload, status, anthropic), "application/json"
        outcome.completed_whole(payload)  # even if a stream was asked for and not given
        self._ended_here(outcome, trace)
        response = Response(payload, status, media_type=content_type)
        response.raw_headers.extend(headers)
        return response

    def _ended_here(self, outcome: Outcome, trace: Trace) -> None:
        """The answer is over: its outcome is told once, and its slot freed with it; its trace ends."""
        if outcome.finish():
            self._routing.leave(outcome.ticket)
            trace.finished(outcome)

    def _stalled(self, outcome: Outcome) -> None:
        log.warning(
            "a client took nothing of its stream from %s for %g s (limits.send_timeout_s): cut off",
            outcome.instance.name,
            self._limits.send_timeout_s,
        )
        self._metrics.client_errors("send_timeout").inc()


def _first_values(request: Request) -> dict[str, str]:
    """The request's headers, each name's first value, as starlette's Headers.get reads them: routing reads
    a dozen, and each read of starlette's scans them all."""
    found: dict[str, str] = {}
    for name, value in request.scope["headers"]:
        found.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
    return found


def _answer_headers(outcome: Outcome, upstream: aiohttp.ClientResponse) -> list[tuple[bytes, bytes]]:
    """The routing headers, and those of the engine's passed on as the bytes it sent: an engine's header
    need not be text the router could re-encode."""
    headers = [(name.encode(), value.encode()) for name, value in routing_headers(outcome).items()]
    passed_on = _PASSED_ON if upstream.status < 400 else _PASSED_ON_ERRORS
    headers += [(name.lower(), value) for name, value in upstream.raw_headers if name.lower() in passed_on]
    return headers


def _bodies_waited(limit_s: float) -> OpenAIError:
    return unavailable(
        f"The router held as many request bodies as it may (limits.max_buffered_body_bytes) for {limit_s:g} s"
        " (limits.body_timeout_s); retry.",
        "bodies_budget",
        RETRY_AFTER_S,
    )


def _shutting_down() -> OpenAIError:
    return unavailable("The router is shutting down; retry.", "shutting_down", RETRY_AFTER_S)


def _error_body(payload: bytes, status: int, anthropic: bool) -> bytes:
    """An upstream error answer with an `error` object (OpenAI's shape, and Anthropic's, which vLLM's
    Messages routes answer but for body validation errors, in OpenAI's) as it is; else its text wrapped in
    the API's shape."""
    try:
        error_object(payload)
        return payload
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        pass
    text = payload.decode("utf-8", "replace").strip()[:_MAX_ERROR_TEXT] or f"HTTP {status}"
    message = f"The instance answered {status}: {text}"
    if anthropic:
        return anthropic_error_json(message, anthropic_error_type(status))
    kind = "upstream_error" if status >= 500 else "invalid_request_error"
    return error_json(message, kind, str(status))
