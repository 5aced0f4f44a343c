"""The request path: parse -> pick a policy -> choose an instance -> forward -> stream back -> observe."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, replace

import aiohttp
import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from router.ab import ABStats
from router.admission import Admission, Overloaded
from router.client_watch import ClientWatch
from router.config import TrafficConfig, UpstreamConfig
from router.errors import (
    OpenAIError,
    bad_request,
    body_timeout,
    client_closed,
    error_json,
    model_not_found,
    too_many_requests,
    unavailable,
    upstream_failed,
    upstream_timeout,
    upstream_unauthorized,
)
from router.health import HealthChecker
from router.instances import Fleet, Instance
from router.memory_hold import MemoryHold
from router.metrics import RouterMetrics
from router.openai_body import Body, decode_body, without_full_kv_report
from router.policy import Policy
from router.relay_response import RelayResponse
from router.retry_budget import RetryBudget
from router.routing import Decision, Prepared, Router
from router.sse import EventFramer
from router.traffic import TrafficSplit

log = logging.getLogger(__name__)

POLICY_HEADER = "x-kvroute-policy"
SESSION_HEADER = "x-session-id"  # traffic.session_header's default, for clients
INSTANCE_HEADER = "x-kvroute-instance"
CACHED_BLOCKS_HEADER = "x-kvroute-cached-blocks"
PROMPT_BLOCKS_HEADER = "x-kvroute-prompt-blocks"
PREDICTED_TTFT_HEADER = "x-kvroute-predicted-ttft-ms"
ATTEMPTS_HEADER = "x-kvroute-attempts"  # instances tried: more than 1 after a retry
# End-to-end headers that identify a request or carry its trace (vLLM reads traceparent and tracestate).
_FORWARDED_HEADERS = ("content-type", "accept", "x-request-id", "traceparent", "tracestate")
_RETURNED_HEADERS = ("x-request-id",)  # the engine's id for the request (--enable-request-id-headers)
_RETRY_AFTER_S = 1
_REFUSED_CREDENTIALS = (401, 403)
_BUSY = 503  # refused before anything ran: not a failure of the instance
_CLIENT_CLOSED = 499  # nginx's code for a client that left before its answer ended
_MAX_ERROR_TEXT = 500  # characters of a non-JSON upstream error kept in the message
# How vLLM reports a failure after a stream began; inside a JSON string a quote is escaped, so no generated
# text can look like it.
_ERROR_EVENT = b'data: {"error"'
_RETRY_BACKOFF_S = 0.05
_DISCARDED = ABStats(max_samples=1)  # results of policies a reload replaced: never read
# No connection to the instance: nothing was sent. A connect timeout is also a TimeoutError, so it is caught
# before the timeouts of requests that were sent.
_NOT_CONNECTED = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
# The instance dropped the connection before answering: it died or restarted.
_DROPPED = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientPayloadError)


@dataclass(eq=False)
class _Prefill:
    """A request's uncached prompt tokens, queued in its instance's prefill count until the engine is past
    them: at the first byte, when the predicted TTFT of a whole answer passes, or at the end at the latest."""

    instance: Instance
    tokens: int

    def take(self) -> int:
        """The tokens still queued, from now on not (0 once taken)."""
        tokens, self.tokens = self.tokens, 0
        return tokens

    def retire(self) -> None:
        self.instance.own_pending_prefill_tokens -= self.take()


@dataclass(eq=False)  # kept in a set by identity
class _Routed:
    decision: Decision
    policy: Policy
    upstream: aiohttp.ClientResponse
    started: float  # this attempt: what the instance's TTFT model learns from
    first_sent: float  # the first attempt: what the client waited, for the policy's metrics
    prefill: _Prefill
    streamed: bool
    finished: bool = False
    broken: bool = False  # the stream from upstream broke off
    engine_error: bool = False  # the engine's stream carried an error event (it failed mid-way)
    cut: bool = False  # ended by the router (shutting down), not by the instance
    completed: bool = False  # relayed to its end (a stream not broken, cut, nor left by its client)
    first: bytes = b""  # a stream's first chunk, or the whole answer
    attempts: int = 1
    probe: bool = False  # the instance's half-open circuit breaker let it through as its probe
    session_key: str | None = None  # the A/B comparison resamples by session
    model: str = ""  # as the client named it (a configured model: the metrics' label values stay few)

    @property
    def instance(self) -> Instance:
        return self.decision.instance


class Proxy:
    def __init__(
        self,
        fleet: Fleet,
        policies: dict[str, Policy],
        traffic: TrafficSplit,
        traffic_config: TrafficConfig,
        router: Router,
        session: aiohttp.ClientSession,
        health: HealthChecker,
        metrics: RouterMetrics,
        config: UpstreamConfig,
        max_tokenized_bytes: int,
        admission: Admission,
        per_instance_limit: int,
        memory_hold_s: float = 0.0,
        thread_above_bytes: int | None = None,
        body_timeout_s: float = 60.0,
        send_timeout_s: float = 60.0,
    ) -> None:
        """memory_hold_s: see router/memory_hold.py. thread_above_bytes: larger bodies are tokenized on a
        worker thread (None: none). body_timeout_s: the longest a client may take to send its body;
        send_timeout_s: to take a stream's next chunk."""
        self._admission, self._per_instance_limit = admission, per_instance_limit
        self._memory_hold: MemoryHold[asyncio.Future[None]] = MemoryHold(memory_hold_s)
        self._max_tokenized_bytes = max_tokenized_bytes
        self._thread_above_bytes = max_tokenized_bytes if thread_above_bytes is None else thread_above_bytes
        self._fleet = fleet
        # Replaced whole by a reload or PUT /admin/traffic; a request keeps the ones it started with.
        self.policies, self.traffic, self.traffic_config = policies, traffic, traffic_config
        self.ab = ABStats()
        self._streams: set[_Routed] = set()  # being relayed to clients
        self._closing = False  # shutting down: streams still starting end at once
        self._starting: set[asyncio.Task[object]] = set()  # requests not yet answered nor streaming
        self._ended: set[asyncio.Task[object]] = set()  # of those, the ones end_streams cancelled
        self._body_timeout_s, self._send_timeout_s = body_timeout_s, send_timeout_s
        self._retry_budget = RetryBudget()
        self._router = router
        self._session, self._health, self._metrics, self._config = session, health, metrics, config
        # sock_connect, not connect: aiohttp's connect timeout also runs while a request waits for a pooled
        # connection, and a busy instance is not an unreachable one. A stream's reads have no socket timeout:
        # its first chunk gets first_byte_timeout_s and every later one stream_idle_timeout_s (aiohttp's
        # sock_read would hold every chunk to the first one's limit).
        self._stream_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=config.connect_timeout_s, sock_read=None
        )
        self._response_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=config.connect_timeout_s, sock_read=config.response_timeout_s
        )

    async def forward(self, request: Request, path: str, kind: type[Body]) -> Response:
        """The answer, or an OpenAIError; one still being routed or computed when the router shuts down is a
        503 the client may retry (the engine aborts it), not the server's plain-text 500."""
        task = asyncio.current_task()
        assert task is not None
        if self._closing:
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

    async def _forward(self, request: Request, path: str, kind: type[Body]) -> Response:
        # The body is read before a slot is taken, and within a time limit: a client that trickles its body
        # must not hold one of the slots that bound the work in flight.
        try:
            async with asyncio.timeout(self._body_timeout_s):
                raw = await request.body()
        except ClientDisconnect:  # gone while sending its body
            raise client_closed() from None
        except TimeoutError:
            raise body_timeout(self._body_timeout_s) from None
        # From here until the answer begins, a client that leaves cancels the work: waiting for a slot (an
        # overloaded router's clients time out), routing, or waiting for the engine.
        with ClientWatch(request.receive) as watch:
            try:
                await self._admission.enter()
                try:
                    routed = await self._route(request, path, kind, raw)
                except BaseException:
                    self._admission.leave()
                    raise
            except Overloaded as exc:
                self._metrics.rejected(str(exc)).inc()
                message = "The router is at capacity; retry later."
                raise too_many_requests(message, str(exc), _RETRY_AFTER_S) from exc
            except asyncio.CancelledError:
                if not watch.client_left():
                    raise
                raise client_closed() from None  # counted with the client errors
        content_type = routed.upstream.headers.get("content-type", "application/json")
        decision = routed.decision
        debug = {
            INSTANCE_HEADER: routed.instance.name,
            POLICY_HEADER: routed.policy.name,
            CACHED_BLOCKS_HEADER: str(decision.cached_blocks),
            PROMPT_BLOCKS_HEADER: str(decision.prompt_blocks),
            PREDICTED_TTFT_HEADER: f"{decision.predicted_ttft_s * 1000:.1f}",
            ATTEMPTS_HEADER: str(routed.attempts),
        }
        for name in _RETURNED_HEADERS:
            if (value := routed.upstream.headers.get(name)) is not None:
                debug[name] = value
        if content_type.startswith("text/event-stream"):
            return RelayResponse(
                self._relay(routed), lambda: self._finish(routed), routed.upstream.status, debug,
                content_type, self._send_timeout_s, lambda: self._stalled(routed),
            )  # fmt: skip
        payload = routed.first
        try:
            status = routed.upstream.status
            if status >= 400:
                payload, content_type = _openai_error_body(payload, status), "application/json"
                # An engine (or a gateway in front of it) that says when to come back is passed on.
                if (retry_after := routed.upstream.headers.get("Retry-After")) is not None:
                    debug["Retry-After"] = retry_after
            usage = _usage(payload)
            if not routed.streamed:  # a stream's first byte was taken when it came (even if not a stream)
                self._first_byte(routed, None if usage is None else usage.completion_tokens)
            if usage is not None and usage.prompt_tokens_details is not None:
                self._ab(routed.policy).observed_cache(
                    routed.policy.name, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens
                )
        finally:
            routed.completed = True  # whole in hand, even if a stream was asked for and not given
            self._finish(routed)
        return Response(payload, routed.upstream.status, headers=debug, media_type=content_type)

    async def _route(self, request: Request, path: str, kind: type[Body], raw: bytes) -> _Routed:
        """Decode, route and send a request that holds a slot, up to its answer's first bytes."""
        body = decode_body(raw, kind, self._fleet.only_model())
        if not self._fleet.serves(body.model):
            raise model_not_found(body.model)
        session = request.headers.get(self.traffic_config.session_header) or body.user
        policy = self._policy(request, session)
        tokenize = len(raw) <= self._max_tokenized_bytes
        raw = without_full_kv_report(raw, body.vllm_xargs)
        # Only these reach the engine: the client's credentials and hop-by-hop headers never do.
        headers = {k: v for k in _FORWARDED_HEADERS if (v := request.headers.get(k)) is not None}
        off_loop = len(raw) > self._thread_above_bytes
        prepared = await self._router.prepare(body, session, tokenize, off_loop)
        return await self._send(prepared, policy, path, raw, headers, bool(body.stream))

    def _policy(self, request: Request, session: str | None) -> Policy:
        header = self.traffic_config.force_header
        forced = request.headers.get(header)
        if forced is None:
            return self.policies[self.traffic.policy_for(session)]
        policy = self.policies.get(forced)
        if policy is None:
            raise bad_request(
                f"Unknown policy {forced!r} in {header}; known: {', '.join(self.policies)}.",
                "unknown_policy",
            )
        return policy

    async def _send(
        self, prepared: Prepared, policy: Policy, path: str, raw: bytes, headers: dict[str, str], stream: bool
    ) -> _Routed:
        """Send to the best instance and wait for the first bytes of its answer (a stream's first chunk, a
        whole answer): until then the client has had nothing, so an instance that fails may be replaced."""
        model = prepared.request.model
        # A stream's first byte comes after prefill; a whole answer only after the last token.
        timeout = self._stream_timeout if stream else self._response_timeout
        tried: set[str] = set()
        dropped: tuple[str, Exception] | None = None  # the last instance that broke off unanswered
        refused: tuple[str, int] | None = None  # the last instance that refused the router's key
        first_sent: float | None = None  # the client's wait includes the attempts that failed
        self._retry_budget.earn()
        prompt_tokens = prepared.request.prompt_tokens
        if self._memory_hold.must_wait(prompt_tokens, self._fleet.candidates(model), prepared.chain):
            await self._hold_for_memory(model, prompt_tokens, prepared.chain)
        for attempt in range(self._config.attempts):
            healthy = self._fleet.candidates(model, exclude=frozenset(tried))
            candidates = [i for i in healthy if i.own_in_flight < self._per_instance_limit]
            if healthy and not candidates:
                self._metrics.rejected("instances_full").inc()
                self._ab(policy).rejected(policy.name)
                raise too_many_requests(
                    f"Every instance serving `{model}` is at capacity; retry later.", "instances_full",
                    _RETRY_AFTER_S,
                )  # fmt: skip
            if not candidates:
                break
            decision = self._router.decide(prepared, policy, candidates)
            instance = decision.instance
            started = time.perf_counter()
            first_sent = started if first_sent is None else first_sent
            probe = self._start(decision)
            prefill = _Prefill(instance, decision.uncached_tokens)
            if not stream and prefill.tokens:
                # A whole answer's first byte comes with its last: its prefill retires when the instance's
                # TTFT model expects the first token instead (an engine answers whole only at the end).
                asyncio.get_running_loop().call_later(decision.predicted_ttft_s, prefill.retire)
            upstream: aiohttp.ClientResponse | None = None
            try:
                sent = {**headers, **instance.headers} if instance.headers else headers
                async with asyncio.timeout(self._config.first_byte_timeout_s if stream else None):
                    upstream = await self._session.post(
                        instance.url + path, data=raw, headers=sent, timeout=timeout
                    )
                    first = await _first_bytes(upstream, stream)
            except _NOT_CONNECTED:
                # Nothing was sent: safe to try another instance, and this one is down for now.
                self._abandon(decision, upstream, probe, prefill, admitted=False)
                self._router.withdraw(decision)
                tried.add(instance.name)
                self._metrics.upstream_errors(instance.name, "connect").inc()
                self._health.mark_unreachable(instance)
                continue
            except _DROPPED as exc:
                # Sent, but the connection broke before the first byte (the instance died or restarted, or
                # closed a kept-alive connection as it was reused): the client has had nothing yet, so another
                # instance may serve it, within the retry budget. One drop does not mark the instance down (a
                # request every engine drops would black out the model): its circuit breaker counts it, and a
                # dead instance refuses the next connection.
                self._abandon(decision, upstream, probe, prefill)
                self._router.withdraw(decision)  # what it computed before dying went with it
                tried.add(instance.name)
                self._metrics.upstream_errors(instance.name, "disconnected").inc()
                dropped = instance.name, exc
                if not self._may_retry(model, attempt, tried):
                    self._ab(policy).failed(policy.name)
                    raise _tried(upstream_failed(instance.name, exc), tried) from exc
                self._metrics.retries(instance.name).inc()
                await asyncio.sleep(_RETRY_BACKOFF_S * len(tried) * random.uniform(0.5, 1.5))
                continue
            except (TimeoutError, aiohttp.ClientError) as exc:
                # Timed out or answered badly: it may still be running there, so it is not sent again.
                self._abandon(decision, upstream, probe, prefill)
                timed_out = isinstance(exc, TimeoutError)  # aiohttp's read timeout is one too
                self._metrics.upstream_errors(instance.name, "timeout" if timed_out else "response").inc()
                self._ab(policy).failed(policy.name)
                if timed_out:
                    limit = "first_byte_timeout_s" if stream else "response_timeout_s"
                    raise _tried(upstream_timeout(instance.name, limit), tried | {instance.name}) from exc
                raise _tried(upstream_failed(instance.name, exc), tried | {instance.name}) from exc
            except BaseException:
                self._abandon(decision, upstream, probe, prefill, failed=False)
                raise
            if upstream.status in _REFUSED_CREDENTIALS:
                # The router's key (clients' never reach engines), which vLLM checks before anything else:
                # nothing ran, and another instance may take it. Counted against this one's breaker.
                self._abandon(decision, upstream, probe, prefill, admitted=False)
                self._router.withdraw(decision)
                tried.add(instance.name)
                self._metrics.upstream_errors(instance.name, "unauthorized").inc()
                refused = instance.name, upstream.status
                continue
            if (
                upstream.status == _BUSY and self._may_retry(model, attempt, tried | {instance.name})
            ):
                # vLLM's admission control (--max-num-queued-reqs, --max-num-queued-tokens) and a fleet being
                # scaled refuse with 503 before anything runs, asking for "a different instance". The last
                # instance's 503 reaches the client, with its Retry-After.
                self._abandon(decision, upstream, probe, prefill, failed=False, admitted=False)
                self._router.withdraw(decision)
                tried.add(instance.name)
                self._metrics.upstream_errors(instance.name, "busy").inc()
                self._metrics.retries(instance.name).inc()
                continue
            self._router.served(decision, policy)
            routed = _Routed(
                decision, policy, upstream, started, first_sent, prefill, streamed=stream, first=first,
                attempts=len(tried) + 1, probe=probe, session_key=prepared.request.session_key, model=model,
            )  # fmt: skip
            try:
                if stream:
                    self._first_byte(routed)
            except BaseException:
                self._abandon(decision, upstream, probe, prefill, failed=False)
                raise
            return routed
        if dropped is not None:
            self._ab(policy).failed(policy.name)
            raise _tried(upstream_failed(*dropped), tried)
        if refused is not None:
            self._ab(policy).failed(policy.name)
            raise _tried(upstream_unauthorized(*refused), tried)
        self._ab(policy).rejected(policy.name)
        if tried:
            message, code = f"No instance serving `{model}` could be reached.", "upstream_unreachable"
        else:
            message, code = f"No healthy instance serves `{model}` right now.", "no_healthy_instance"
        self._metrics.rejected(code).inc()
        raise _tried(unavailable(message + " Retry later.", code, _RETRY_AFTER_S), tried)

    def _may_retry(self, model: str, attempt: int, tried: set[str]) -> bool:
        """Whether a request whose attempt failed may go to another instance: an attempt left, an instance
        not tried with room for it, and the retry budget, spent only then."""
        return (
            attempt + 1 < self._config.attempts
            and any(
                other.own_in_flight < self._per_instance_limit
                for other in self._fleet.candidates(model, exclude=frozenset(tried))
            )
            and self._retry_budget.spend()
        )

    async def _hold_for_memory(self, model: str, prompt_tokens: int, chain: Sequence[int]) -> None:
        """Wait until some instance has KV memory for the prompt, or the hold's bound passes."""
        hold, held = self._memory_hold, time.perf_counter()
        released: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        hold.hold(released, prompt_tokens, lambda: self._fleet.candidates(model), chain)
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for returns a result that came in the same turn as a
            # cancellation, and the request would go upstream for a client that has gone.
            async with asyncio.timeout(hold.max_hold_s):
                await asyncio.shield(released)
        except TimeoutError:
            pass
        finally:
            # No await from here to the decision: a released prompt goes from granted to in flight at once.
            if released.done():
                hold.started(prompt_tokens)
            else:
                released.cancel()
                hold.drop(released)
            self._metrics.memory_hold(model).observe(time.perf_counter() - held)

    def _abandon(
        self,
        decision: Decision,
        upstream: aiohttp.ClientResponse | None,
        probe: bool,
        prefill: _Prefill,
        failed: bool = True,
        admitted: bool = True,
    ) -> None:
        """A request that never reached the client: free what it held; failed: count it against the
        instance's circuit breaker; admitted: the engine may have held its context (it was sent)."""
        if upstream is not None:
            upstream.close()  # not released to the pool: the engine must see the connection go (abort)
        self._end(decision, prefill, admitted=admitted)
        if failed:
            self._breaker_failed(decision.instance, probe)
        else:
            decision.instance.breaker.abandoned(probe)

    def _ab(self, policy: Policy) -> ABStats:
        """Where policy's A/B results go: nowhere once a reload has replaced or removed it, so that a policy
        defined afresh under its name starts from nothing, whatever the old one still had in flight."""
        return self.ab if self.policies.get(policy.name) is policy else _DISCARDED

    def _breaker_failed(self, instance: Instance, probe: bool) -> None:
        if instance.breaker.failed(probe):
            failures = instance.breaker.failures
            log.warning("circuit breaker for %s opened after %d failures in a row", instance.name, failures)
            self._metrics.circuit_opens(instance.name).inc()
            self._metrics.circuit_open(instance.name).set(1)

    def _breaker_succeeded(self, instance: Instance, probe: bool) -> None:
        if probe:
            log.info("circuit breaker for %s closed: a probe request succeeded", instance.name)
        instance.breaker.succeeded(probe)
        if instance.breaker.opened_at is None:
            self._metrics.circuit_open(instance.name).set(0)

    async def _relay(self, routed: _Routed) -> AsyncGenerator[bytes, None]:
        """Pass SSE chunks through as they arrive; a broken upstream ends the stream with an error event."""
        content, idle_s = routed.upstream.content, self._config.stream_idle_timeout_s
        events = EventFramer()  # a break mid-event drops the half event before the error event
        self._streams.add(routed)
        try:
            if whole := events.whole(routed.first):
                self._watch_errors(routed, whole)
                yield whole
            if self._closing:  # its first chunk came after end_streams
                routed.cut = True
                routed.upstream.close()
            while True:
                async with asyncio.timeout(idle_s):
                    chunk = await content.readany()
                if not chunk:
                    if routed.cut:  # closed under the read, which saw an end rather than an error
                        raise aiohttp.ClientConnectionError("ended by the router")
                    if rest := events.rest():
                        yield rest
                    routed.completed = True
                    return
                if whole := events.whole(chunk):
                    self._watch_errors(routed, whole)
                    yield whole
        except (TimeoutError, aiohttp.ClientError) as exc:
            routed.broken = True
            if routed.cut:
                yield _sse_error("the router is shutting down; the stream was ended early", "shutting_down")
            else:
                log.warning("stream from %s broke: %r", routed.instance.name, exc)
                kind = "stream_idle" if isinstance(exc, TimeoutError) else "stream"
                self._metrics.upstream_errors(routed.instance.name, kind).inc()
                yield _sse_error(f"the upstream instance failed mid-stream: {type(exc).__name__}")
            yield b"data: [DONE]\n\n"
        finally:
            self._streams.discard(routed)
            self._finish(routed)

    def _watch_errors(self, routed: _Routed, events: bytes) -> None:
        """An engine failure the stream reports (its error event) counts against the instance."""
        if _ERROR_EVENT in events and not routed.engine_error and _server_error_event(events):
            routed.engine_error = True
            self._metrics.upstream_errors(routed.instance.name, "stream_error").inc()

    def _stalled(self, routed: _Routed) -> None:
        log.warning(
            "a client took nothing of its stream from %s for %g s (limits.send_timeout_s): cut off",
            routed.instance.name, self._send_timeout_s,
        )  # fmt: skip
        self._metrics.client_errors("send_timeout").inc()

    def end_streams(self) -> None:
        """Shutting down: end every stream still relayed with an error event and [DONE], now, rather than
        have the server cut the connections without notice."""
        self._closing = True
        for routed in list(self._streams):
            routed.cut = True
            routed.upstream.close()  # the relay's read fails at once; the engine aborts the request
        for task in self._starting - self._ended:  # waiting for a first byte, a whole answer, or a slot
            self._ended.add(task)
            task.cancel()

    def _finish(self, routed: _Routed) -> None:
        if routed.finished:
            return
        routed.finished = True
        self._admission.leave()
        routed.upstream.release()
        status = routed.upstream.status
        self._end(routed.decision, routed.prefill, admitted=status == 200)
        if status >= 400:  # refused or failed: the engine computed nothing of it
            self._router.withdraw(routed.decision)
        # A stream that ended neither whole, broken nor cut by the router was left by its client mid-way: its
        # time is not an answer's, and it says nothing of the instance.
        left = routed.streamed and status == 200 and not (routed.completed or routed.broken or routed.cut)
        failed = routed.broken or routed.engine_error
        if (failed and not routed.cut) or (status >= 500 and status != _BUSY):
            self._breaker_failed(routed.instance, routed.probe)
        elif routed.cut or left or status >= 400:
            # Ended by the router or the client, or the client's mistake: nothing learnt about the instance.
            routed.instance.breaker.abandoned(routed.probe)
        else:
            self._breaker_succeeded(routed.instance, routed.probe)
        if left:
            status = _CLIENT_CLOSED
        policy = routed.policy.name
        self._metrics.requests(policy, routed.instance.name, str(status), routed.model).inc()
        elapsed = time.perf_counter() - routed.first_sent
        answered = status == 200 and not failed
        if answered:
            self._metrics.e2e(policy, routed.model).observe(elapsed)
        decision = routed.decision
        self._ab(routed.policy).finished(
            policy, routed.instance.name, 502 if failed else status, elapsed if answered else None,
            decision.prompt_tokens, decision.prompt_tokens - decision.uncached_tokens,
        )  # fmt: skip

    def _start(self, decision: Decision) -> bool:
        """Count the request against its instance; True when it is the instance's circuit-breaker probe."""
        instance = decision.instance
        probe = instance.breaker.sent()
        instance.start(decision.prompt_tokens, decision.uncached_tokens, decision.chain)
        self._metrics.in_flight(instance.name).set(instance.own_in_flight)
        self._metrics.ttft_predicted(instance.name).observe(decision.predicted_ttft_s)
        return probe

    def _first_byte(self, routed: _Routed, decoded_tokens: int | None = None) -> None:
        """decoded_tokens: for a whole answer, how many tokens it generated (None: unknown). Only answers
        (200) count as TTFT samples: an error comes back fast and would flatter its policy."""
        routed.prefill.retire()
        if routed.upstream.status != 200:
            return
        now = time.perf_counter()
        waited, elapsed = now - routed.first_sent, now - routed.started
        self._metrics.ttft(routed.policy.name, routed.model).observe(waited)
        self._ab(routed.policy).first_byte(routed.policy.name, waited, routed.session_key)
        decision, name = routed.decision, routed.instance.name
        model = routed.instance.ttft_model
        if routed.streamed:
            model.observe(decision.features, elapsed)
            self._metrics.ttft_observed(name).observe(elapsed)
            self._metrics.ttft_error(name).observe(elapsed - decision.predicted_ttft_s)
        elif decoded_tokens is not None:
            model.observe(replace(decision.features, decoded_tokens=decoded_tokens), elapsed)
        else:
            return
        if model.solved == model.observations:  # the rates just changed
            for term, rate in model.rates.items():
                self._metrics.ttft_rate(name, term).set(rate)

    def _end(self, decision: Decision, prefill: _Prefill, admitted: bool) -> None:
        instance = decision.instance
        instance.end(decision.prompt_tokens, prefill.take(), admitted, decision.chain)
        self._metrics.in_flight(instance.name).set(instance.own_in_flight)
        self.memory_freed()

    def memory_freed(self) -> None:
        """A request ended here or at a peer router: the held requests that now fit go."""
        if len(self._memory_hold):
            for released in self._memory_hold.release():
                released.set_result(None)


class _PromptDetails(msgspec.Struct):
    cached_tokens: int = 0


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _PromptDetails | None = None


class _Answer(msgspec.Struct):
    usage: _Usage | None = None


_decode_answer = msgspec.json.Decoder(_Answer).decode


def _tried(error: OpenAIError, tried: set[str]) -> OpenAIError:
    """error, saying how many instances the request was sent to, as an answer does."""
    error.headers[ATTEMPTS_HEADER] = str(len(tried))
    return error


def _shutting_down() -> OpenAIError:
    return unavailable("The router is shutting down; retry.", "shutting_down", _RETRY_AFTER_S)


def _usage(payload: bytes) -> _Usage | None:
    """A whole answer's usage, if it has one."""
    try:
        return _decode_answer(payload).usage
    except (msgspec.DecodeError, RecursionError):  # an engine's answer nested past the decoder's depth
        return None


async def _first_bytes(upstream: aiohttp.ClientResponse, stream: bool) -> bytes:
    """A successful stream's first chunk; otherwise the whole answer (an error's is short), also when a stream
    was asked for and a whole answer came (a gateway in front of the engine), which is relayed whole."""
    if not (stream and upstream.status == 200 and upstream.content_type == "text/event-stream"):
        return await upstream.read()
    first = await upstream.content.readany()
    if not first:  # a 200 stream that ends before its first chunk is broken, not empty
        raise aiohttp.ServerDisconnectedError()
    return first


class _ErrorShape(msgspec.Struct):
    error: dict[str, object]


def _server_error_event(events: bytes) -> bool:
    """Whether the first error event in events is the engine's failure (its code 5xx, or none), not a
    refusal of the client's request (4xx), which says nothing against the instance."""
    start = events.index(_ERROR_EVENT) + len(b"data: ")
    end = events.find(b"\n", start)
    try:
        data = events[start : end if end >= 0 else None]
        code = msgspec.json.decode(data, type=_ErrorShape).error.get("code")
    except (msgspec.DecodeError, RecursionError):
        return True
    return not (isinstance(code, int) and 400 <= code < 500)


def _openai_error_body(payload: bytes, status: int) -> bytes:
    """An upstream error answer in OpenAI's shape: as it is when it has one, else its text wrapped in one."""
    try:
        msgspec.json.decode(payload, type=_ErrorShape)
        return payload
    except (msgspec.DecodeError, RecursionError):
        pass
    text = payload.decode("utf-8", "replace").strip()[:_MAX_ERROR_TEXT] or f"HTTP {status}"
    kind = "upstream_error" if status >= 500 else "invalid_request_error"
    return error_json(f"The instance answered {status}: {text}", kind, str(status))


def _sse_error(message: str, code: str = "stream_broken") -> bytes:
    return b"data: " + error_json(message, "upstream_error", code) + b"\n\n"
