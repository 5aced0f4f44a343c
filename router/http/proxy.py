"""kvroute serve's front door: a request's body read within its limits, routed by the routing service
(router/dispatch/routing.py), and the answer made for the client: a stream relayed event by event
(router/dispatch/relay.py), a whole answer in one piece. What became of it is told by its outcome
(router/dispatch/outcome.py).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import aiohttp
import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from router.dispatch.cached_tokens import with_cached_tokens
from router.dispatch.outcome import Outcome
from router.dispatch.relay import Relay
from router.dispatch.routing import Kind, RoutingService
from router.dispatch.routing_headers import routing_headers
from router.errors import (
    RETRY_AFTER_S,
    OpenAIError,
    body_timeout,
    client_closed,
    error_json,
    error_object,
    unavailable,
)
from router.http.client_watch import ClientWatch
from router.http.relay_response import RelayResponse
from router.metrics import RouterMetrics

log = logging.getLogger(__name__)

_RETURNED_HEADERS = ("x-request-id",)  # the engine's id for the request (--enable-request-id-headers)
_MAX_ERROR_TEXT = 500  # characters of a non-JSON upstream error kept in the message


@dataclass(frozen=True)
class BodyLimits:
    body_timeout_s: float = 60.0  # the longest a client may take to send its body
    send_timeout_s: float = 60.0  # to take a stream's next chunk


class Proxy:
    def __init__(
        self, routing: RoutingService, relay: Relay, metrics: RouterMetrics, limits: BodyLimits
    ) -> None:
        self._routing, self._relay, self._metrics, self._limits = routing, relay, metrics, limits
        self._starting: set[asyncio.Task[object]] = set()  # requests not yet answered nor streaming
        self._ended: set[asyncio.Task[object]] = set()  # of those, the ones end_streams cancelled

    async def forward(self, request: Request, path: str, kind: Kind) -> Response:
        """The answer, or an OpenAIError; one still being routed or computed when the router shuts down is a
        503 the client may retry (the engine aborts it), not the server's plain-text 500."""
        task = asyncio.current_task()
        assert task is not None
        if self._relay.closing:
            raise _shutting_down()
        self._starting.add(task)
        try:
            return await self._forward(request, path, kind)
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

    async def _forward(self, request: Request, path: str, kind: Kind) -> Response:
        # The body is read before a slot is taken, and within a time limit: a client that trickles its body
        # must not hold one of the slots that bound the work in flight.
        limits = self._limits
        try:
            async with asyncio.timeout(limits.body_timeout_s):
                raw = await request.body()
        except ClientDisconnect:  # gone while sending its body
            raise client_closed() from None
        except TimeoutError:
            raise body_timeout(limits.body_timeout_s) from None
        # From here until the answer begins, a client that leaves cancels the work: waiting for a slot (an
        # overloaded router's clients time out), routing, or waiting for the engine.
        routing = self._routing
        with ClientWatch(request.receive) as watch:
            try:
                await routing.admit()
                try:
                    received = routing.receive(raw, kind, request.headers)
                    outcome = await routing.send(received, await routing.prepare(received), path)
                except BaseException:
                    routing.leave()
                    raise
            except asyncio.CancelledError:
                if not watch.client_left():
                    raise
                raise client_closed() from None  # counted with the client errors
        upstream = outcome.upstream
        assert isinstance(upstream, aiohttp.ClientResponse)
        content_type = upstream.headers.get("content-type", "application/json")
        debug = routing_headers(outcome)
        for name in _RETURNED_HEADERS:
            if (value := upstream.headers.get(name)) is not None:
                debug[name] = value
        if content_type.startswith("text/event-stream"):
            return RelayResponse(
                self._relay.stream(outcome, self._ended_here),
                lambda: self._ended_here(outcome),
                upstream.status,
                debug,
                content_type,
                limits.send_timeout_s,
                lambda: self._stalled(outcome),
            )
        payload = outcome.first
        if outcome.prefill_cached_tokens is not None:
            payload = with_cached_tokens(payload, outcome.prefill_cached_tokens)
        try:
            status = upstream.status
            if status >= 400:
                payload, content_type = _openai_error_body(payload, status), "application/json"
                # An engine (or a gateway in front of it) that says when to come back is passed on.
                if (retry_after := upstream.headers.get("Retry-After")) is not None:
                    debug["Retry-After"] = retry_after
            outcome.completed_whole(payload)  # even if a stream was asked for and not given
        finally:
            self._ended_here(outcome)
        return Response(payload, upstream.status, headers=debug, media_type=content_type)

    def _ended_here(self, outcome: Outcome) -> None:
        """The answer is over: its outcome is told once, and its slot freed with it."""
        if outcome.finish():
            self._routing.leave()

    def _stalled(self, outcome: Outcome) -> None:
        log.warning(
            "a client took nothing of its stream from %s for %g s (limits.send_timeout_s): cut off",
            outcome.instance.name,
            self._limits.send_timeout_s,
        )
        self._metrics.client_errors("send_timeout").inc()


def _shutting_down() -> OpenAIError:
    return unavailable("The router is shutting down; retry.", "shutting_down", RETRY_AFTER_S)


def _openai_error_body(payload: bytes, status: int) -> bytes:
    """An upstream error answer in OpenAI's shape: as it is when it has one, else its text wrapped in one."""
    try:
        error_object(payload)
        return payload
    except (msgspec.DecodeError, RecursionError):
        pass
    text = payload.decode("utf-8", "replace").strip()[:_MAX_ERROR_TEXT] or f"HTTP {status}"
    kind = "upstream_error" if status >= 500 else "invalid_request_error"
    return error_json(f"The instance answered {status}: {text}", kind, str(status))
