"""Receive: a request's body read within its limits, a slot taken, and the answer made for the client.

The way of a request: the body is decoded (router/prompt/), its policy picked from the routing table in
force, its prompt prepared (tokenized, hashed, looked up in the index) and sent to the chosen instance with
retries (router/dispatch/attempts.py); the answer is relayed (router/dispatch/relay.py) and what became of it
is told everywhere by its outcome (router/dispatch/outcome.py).
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

from router.dispatch.admission import Admission, Overloaded
from router.dispatch.attempts import ATTEMPTS_HEADER, RETRY_AFTER_S, Attempts
from router.dispatch.cached_tokens import with_cached_tokens
from router.dispatch.decision import Decider
from router.dispatch.outcome import Outcome
from router.dispatch.relay import Relay
from router.dispatch.routing_table import RoutingTable
from router.errors import (
    OpenAIError,
    body_timeout,
    client_closed,
    error_json,
    error_object,
    model_not_found,
    too_many_requests,
    unavailable,
)
from router.http.client_watch import ClientWatch
from router.http.relay_response import RelayResponse
from router.metrics import RouterMetrics
from router.prompt.openai_body import Body, decode_body, without_full_kv_report
from router.upstreams.instances import Upstreams

log = logging.getLogger(__name__)

POLICY_HEADER = "x-kvroute-policy"
SESSION_HEADER = "x-session-id"  # traffic.session_header's default, for clients
INSTANCE_HEADER = "x-kvroute-instance"  # the decode instance of a disaggregated request
PREFILL_INSTANCE_HEADER = "x-kvroute-prefill-instance"  # where its prompt's KV was computed
CACHED_BLOCKS_HEADER = "x-kvroute-cached-blocks"
PROMPT_BLOCKS_HEADER = "x-kvroute-prompt-blocks"
PREDICTED_TTFT_HEADER = "x-kvroute-predicted-ttft-ms"
WAIT_CAUSED_HEADER = "x-kvroute-wait-caused-ms"  # what the policy charged it for the wait of those behind
# End-to-end headers that identify a request or carry its trace (vLLM reads traceparent and tracestate).
_FORWARDED_HEADERS = ("content-type", "accept", "x-request-id", "traceparent", "tracestate")
_RETURNED_HEADERS = ("x-request-id",)  # the engine's id for the request (--enable-request-id-headers)
_MAX_ERROR_TEXT = 500  # characters of a non-JSON upstream error kept in the message


@dataclass(frozen=True)
class BodyLimits:
    max_tokenized_bytes: int  # larger bodies are routed without prefix knowledge
    thread_above_bytes: int  # larger ones are tokenized on a worker thread
    body_timeout_s: float = 60.0  # the longest a client may take to send its body
    send_timeout_s: float = 60.0  # to take a stream's next chunk


class Proxy:
    def __init__(
        self,
        upstreams: Upstreams,
        table: Callable[[], RoutingTable],
        decider: Decider,
        attempts: Attempts,
        relay: Relay,
        admission: Admission,
        metrics: RouterMetrics,
        limits: BodyLimits,
    ) -> None:
        self._upstreams, self._decider, self._attempts, self._relay = upstreams, decider, attempts, relay
        self._admission, self._metrics, self._limits = admission, metrics, limits
        self._table = table  # the one in force: a reload or PUT /admin/traffic replaces it whole
        self._starting: set[asyncio.Task[object]] = set()  # requests not yet answered nor streaming
        self._ended: set[asyncio.Task[object]] = set()  # of those, the ones end_streams cancelled

    async def forward(self, request: Request, path: str, kind: type[Body]) -> Response:
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

    async def _forward(self, request: Request, path: str, kind: type[Body]) -> Response:
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
        with ClientWatch(request.receive) as watch:
            try:
                await self._admission.enter()
                try:
                    outcome = await self._route(request, path, kind, raw)
                except BaseException:
                    self._admission.leave()
                    raise
            except Overloaded as exc:
                self._metrics.rejected(str(exc)).inc()
                message = "The router is at capacity; retry later."
                raise too_many_requests(message, str(exc), RETRY_AFTER_S) from exc
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
            usage = answer_usage(payload)
            if not outcome.streamed:  # a stream's first byte was taken when it came (even if not a stream)
                outcome.first_byte(None if usage is None else usage.completion_tokens)
            if usage is not None and usage.prompt_tokens_details is not None:
                outcome.observed_cache(usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens)
        finally:
            outcome.completed = True  # whole in hand, even if a stream was asked for and not given
            self._ended_here(outcome)
        return Response(payload, upstream.status, headers=debug, media_type=content_type)

    async def _route(self, request: Request, path: str, kind: type[Body], raw: bytes) -> Outcome:
        """Decode, route and send a request that holds a slot, up to its answer's first bytes."""
        body = decode_body(raw, kind, self._upstreams.only_model())
        if not self._upstreams.serves(body.model):
            raise model_not_found(body.model)
        table = self._table()
        session = request.headers.get(table.traffic.session_header) or body.user
        policy = table.policy_for(request.headers.get(table.traffic.force_header), session)
        tokenize = len(raw) <= self._limits.max_tokenized_bytes
        raw = without_full_kv_report(raw, body.vllm_xargs)
        # Only these reach the engine: the client's credentials and hop-by-hop headers never do.
        headers = {k: v for k in _FORWARDED_HEADERS if (v := request.headers.get(k)) is not None}
        off_loop = len(raw) > self._limits.thread_above_bytes
        prepared = await self._decider.prepare(body, session, tokenize, off_loop)
        return await self._attempts.send(prepared, policy, path, raw, headers, bool(body.stream))

    def _ended_here(self, outcome: Outcome) -> None:
        """The answer is over: its outcome is told once, and its slot freed with it."""
        if outcome.finish():
            self._admission.leave()

    def _stalled(self, outcome: Outcome) -> None:
        log.warning(
            "a client took nothing of its stream from %s for %g s (limits.send_timeout_s): cut off",
            outcome.instance.name,
            self._limits.send_timeout_s,
        )
        self._metrics.client_errors("send_timeout").inc()


class _PromptDetails(msgspec.Struct):
    cached_tokens: int = 0


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _PromptDetails | None = None


class _Answer(msgspec.Struct):
    usage: _Usage | None = None


_decode_answer = msgspec.json.Decoder(_Answer).decode


def _shutting_down() -> OpenAIError:
    return unavailable("The router is shutting down; retry.", "shutting_down", RETRY_AFTER_S)


def routing_headers(outcome: Outcome) -> dict[str, str]:
    """What the answer tells of its routing: the instance (and a disaggregated request's prefill instance),
    the policy, the prefix it was predicted to reuse, the TTFT and the wait it was charged for causing, the
    instances tried."""
    decision = outcome.decision
    headers = {
        INSTANCE_HEADER: outcome.instance.name,
        POLICY_HEADER: outcome.policy.name,
        CACHED_BLOCKS_HEADER: str(decision.cached_blocks),
        PROMPT_BLOCKS_HEADER: str(decision.prompt_blocks),
        PREDICTED_TTFT_HEADER: f"{decision.predicted_ttft_s * 1000:.1f}",
        WAIT_CAUSED_HEADER: f"{decision.wait_caused_s * 1000:.1f}",
        ATTEMPTS_HEADER: str(outcome.attempts),
    }
    if outcome.prefill_instance is not None:
        headers[PREFILL_INSTANCE_HEADER] = outcome.prefill_instance
    return headers


def answer_usage(payload: bytes) -> _Usage | None:
    """A whole answer's usage, if it has one."""
    try:
        return _decode_answer(payload).usage
    except (msgspec.DecodeError, RecursionError):  # an engine's answer nested past the decoder's depth
        return None


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
