"""Send: choose an instance, send the request, and try another while the client has had nothing yet.

Until the first bytes of an answer (a stream's first chunk, a whole answer) reach the client, an instance
that cannot be reached, drops the connection, refuses the router's key or is busy may be replaced by another,
within the attempts and the retry budget. Each attempt's outcome is told to the rest of the router by
router/dispatch/outcome.py.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
import msgspec

from router.config import DisaggregationConfig, UpstreamConfig
from router.dispatch.decision import Decider, Decision, Prepared
from router.dispatch.failures import DROPPED, NOT_CONNECTED, REFUSED_CREDENTIALS
from router.dispatch.memory_gate import MemoryGate
from router.dispatch.outcome import BUSY, Leg, Observers, Outcome, PdPath
from router.dispatch.prefill_leg import NoPrefill, PrefillLeg, Transfer, decode_body
from router.dispatch.retry_budget import RetryBudget
from router.errors import (
    OpenAIError,
    too_many_requests,
    unavailable,
    upstream_failed,
    upstream_timeout,
    upstream_unauthorized,
)
from router.metrics import RouterMetrics
from router.upstreams.health import HealthChecker
from router.upstreams.instances import Instance, Upstreams
from router.upstreams.room import with_room
from scorers.policy import Policy

log = logging.getLogger(__name__)

ATTEMPTS_HEADER = "x-kvroute-attempts"  # instances tried: more than 1 after a retry
RETRY_AFTER_S = 1
_RETRY_BACKOFF_S = 0.05


class Attempts:
    def __init__(
        self,
        upstreams: Upstreams,
        decider: Decider,
        observers: Observers,
        session: aiohttp.ClientSession,
        health: HealthChecker,
        metrics: RouterMetrics,
        config: UpstreamConfig,
        per_instance_limit: int,
        memory_hold_s: float = 0.0,
        disaggregation: DisaggregationConfig | None = None,
        max_waiting: int | None = None,
    ) -> None:
        """per_instance_limit: requests this router has in flight on one instance at most; memory_hold_s: see
        router/dispatch/memory_gate.py; disaggregation: how disaggregated models' prefill legs go
        (router/dispatch/prefill_leg.py); max_waiting: the engines' waiting-queue limit, if they have one
        (router/upstreams/room.py)."""
        self._upstreams, self._decider, self._observers = upstreams, decider, observers
        self._session, self._health, self._metrics, self._config = session, health, metrics, config
        self._per_instance_limit, self._max_waiting = per_instance_limit, max_waiting
        self._memory_gate: MemoryGate[asyncio.Future[None]] = MemoryGate(memory_hold_s)
        self._retry_budget = RetryBudget()
        disaggregation = disaggregation or DisaggregationConfig()
        self._prefill = PrefillLeg(
            upstreams,
            decider,
            observers,
            session,
            health,
            metrics,
            config,
            disaggregation.connector,
            disaggregation.local_prefill_max_tokens,
            per_instance_limit,
            self._retry_budget,
            max_waiting,
        )
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

    async def send(
        self, prepared: Prepared, policy: Policy, path: str, raw: bytes, headers: dict[str, str], stream: bool
    ) -> Outcome:
        """Send to the best instance and wait for the first bytes of its answer: the outcome that serves the
        client, or an OpenAIError saying why none could."""
        model = prepared.request.model
        # A stream's first byte comes after prefill; a whole answer only after the last token.
        timeout = self._stream_timeout if stream else self._response_timeout
        tried: set[str] = set()
        dropped: tuple[str, Exception] | None = None  # the last instance that broke off unanswered
        refused: tuple[str, int] | None = None  # the last instance that refused the router's key
        first_sent: float | None = None  # the client's wait includes the attempts that failed
        transfer: Transfer | None = None  # a prefill leg's KV that the next decode leg may still fetch
        body: dict[str, Any] | None = None  # the client's, decoded once a disaggregated leg needs it
        ab = self._observers.ab_for
        self._retry_budget.earn()
        prompt_tokens = prepared.request.prompt_tokens
        if self._memory_gate.must_wait(prompt_tokens, self._upstreams.candidates(model), prepared.chain):
            await self._hold_for_memory(model, prompt_tokens, prepared.chain)
        for attempt in range(self._config.attempts):
            candidates = self.candidates(model, policy, frozenset(tried))
            if not candidates:
                break
            decision = self._decider.decide(prepared, policy, candidates)
            instance = decision.instance
            leg, pd_path = self._leg(model, decision, transfer)
            sent_decision = self._decider.decode_leg(decision) if leg == "decode" else decision
            outcome = Outcome.start(self._observers, sent_decision, policy, model, stream, first_sent, leg)
            outcome.pd_path = pd_path
            first_sent = outcome.first_sent
            payload = raw
            if leg == "decode":
                body = msgspec.json.decode(raw) if body is None else body
                try:
                    transfer = transfer or await self._prefill.run(
                        prepared, policy, path, body, headers, instance.name
                    )
                except NoPrefill as exc:
                    # The decode instance computes the prompt itself: a whole request, as aggregated.
                    log.debug("no prefill leg: %s", exc)
                    outcome.abandon(None, failed=False, admitted=False)
                    outcome = Outcome.start(self._observers, decision, policy, model, stream, first_sent)
                    outcome.pd_path = "fallback"
                except BaseException:  # the client left, or the prefill leg timed out
                    outcome.abandon(None, failed=False, admitted=False, withdraw=True)
                    raise
                else:
                    outcome.transferred(transfer.instance.name, transfer.cached_tokens)
                    payload = decode_body(body, transfer)
            upstream: aiohttp.ClientResponse | None = None
            try:
                sent = {**headers, **instance.headers} if instance.headers else headers
                async with asyncio.timeout(self._config.first_byte_timeout_s if stream else None):
                    upstream = await self._session.post(
                        instance.url + path, data=payload, headers=sent, timeout=timeout
                    )
                    first = await _first_bytes(upstream, stream)
            except NOT_CONNECTED:
                # Nothing was sent: safe to try another instance, and this one is down for now.
                outcome.abandon(upstream, admitted=False, withdraw=True)
                tried.add(instance.name)
                self._metrics.upstream_errors(instance.name, "connect").inc()
                self._health.mark_unreachable(instance)
                continue
            except DROPPED as exc:
                # Sent, but the connection broke before the first byte (the instance died or restarted, or
                # closed a kept-alive connection as it was reused): the client has had nothing yet, so another
                # instance may serve it, within the retry budget. One drop does not mark the instance down (a
                # request every engine drops would black out the model): its circuit breaker counts it, and a
                # dead instance refuses the next connection. What it computed before dying went with it.
                outcome.abandon(upstream, withdraw=True)
                tried.add(instance.name)
                self._metrics.upstream_errors(instance.name, "disconnected").inc()
                dropped = instance.name, exc
                transfer = None  # it may have fetched the KV, which the prefill instance then let go
                if not self._may_retry(model, attempt, tried):
                    ab(policy).failed(policy.name)
                    raise _tried(upstream_failed(instance.name, exc), tried) from exc
                self._metrics.retries(instance.name).inc()
                await asyncio.sleep(_RETRY_BACKOFF_S * len(tried) * random.uniform(0.5, 1.5))
                continue
            except (TimeoutError, aiohttp.ClientError) as exc:
                # Timed out or answered badly: it may still be running there, so it is not sent again.
                outcome.abandon(upstream)
                timed_out = isinstance(exc, TimeoutError)  # aiohttp's read timeout is one too
                self._metrics.upstream_errors(instance.name, "timeout" if timed_out else "response").inc()
                ab(policy).failed(policy.name)
                if timed_out:
                    limit = "first_byte_timeout_s" if stream else "response_timeout_s"
                    raise _tried(upstream_timeout(instance.name, limit), tried | {instance.name}) from exc
                raise _tried(upstream_failed(instance.name, exc), tried | {instance.name}) from exc
            except BaseException:
                outcome.abandon(upstream, failed=False)
                raise
            if upstream.status in REFUSED_CREDENTIALS:
                # The router's key (clients' never reach engines), which vLLM checks before anything else:
                # nothing ran, and another instance may take it. Counted against this one's breaker.
                outcome.abandon(upstream, admitted=False, withdraw=True)
                tried.add(instance.name)
                self._metrics.upstream_errors(instance.name, "unauthorized").inc()
                refused = instance.name, upstream.status
                continue
            if upstream.status == BUSY and self._may_retry(model, attempt, tried | {instance.name}):
                # vLLM's admission control (--max-num-queued-reqs, --max-num-queued-tokens) and a fleet being
                # scaled refuse with 503 before anything runs, asking for "a different instance". The last
                # instance's 503 reaches the client, with its Retry-After.
                outcome.abandon(upstream, failed=False, admitted=False, withdraw=True)
                tried.add(instance.name)
                self._metrics.upstream_errors(instance.name, "busy").inc()
                self._metrics.retries(instance.name).inc()
                continue
            try:
                outcome.answered(upstream, first, attempts=len(tried) + 1)
            except BaseException:
                outcome.abandon(upstream, failed=False)
                raise
            return outcome
        if dropped is not None:
            ab(policy).failed(policy.name)
            raise _tried(upstream_failed(*dropped), tried)
        if refused is not None:
            ab(policy).failed(policy.name)
            raise _tried(upstream_unauthorized(*refused), tried)
        ab(policy).rejected(policy.name)
        if tried:
            message, code = f"No instance serving `{model}` could be reached.", "upstream_unreachable"
        else:
            message, code = f"No healthy instance serves `{model}` right now.", "no_healthy_instance"
        self._metrics.rejected(code).inc()
        raise _tried(unavailable(message + " Retry later.", code, RETRY_AFTER_S), tried)

    def candidates(self, model: str, policy: Policy, exclude: frozenset[str] = frozenset()) -> list[Instance]:
        """The healthy instances serving model, but those in exclude, that have room for one more request of
        this router; a 429 when every healthy one is full."""
        healthy = self._upstreams.candidates(model, exclude=exclude)
        candidates = with_room(healthy, self._per_instance_limit, self._max_waiting)
        if healthy and not candidates:
            self._metrics.rejected("instances_full").inc()
            self._observers.ab_for(policy).rejected(policy.name)
            raise too_many_requests(
                f"Every instance serving `{model}` is at capacity; retry later.",
                "instances_full",
                RETRY_AFTER_S,
            )
        return candidates

    def _leg(self, model: str, decision: Decision, transfer: Transfer | None) -> tuple[Leg, PdPath | None]:
        """What the attempt at decision's instance is: a whole request (and, of a disaggregated model, why)
        or the decode leg after a prefill leg (done already when transfer is one still to fetch)."""
        if not self._upstreams.disaggregated(model):
            return "whole", None
        if transfer is not None or self._prefill.worth_it(decision):
            return "decode", None
        return "whole", "skipped"

    def memory_freed(self) -> None:
        """A request ended here or at a peer router: the held requests that now fit go."""
        if len(self._memory_gate):
            for released in self._memory_gate.release():
                released.set_result(None)

    def _may_retry(self, model: str, attempt: int, tried: set[str]) -> bool:
        """Whether a request whose attempt failed may go to another instance: an attempt left, an instance
        not tried with room for it, and the retry budget, spent only then."""
        return (
            attempt + 1 < self._config.attempts
            and any(
                other.own_in_flight < self._per_instance_limit
                for other in self._upstreams.candidates(model, exclude=frozenset(tried))
            )
            and self._retry_budget.spend()
        )

    async def _hold_for_memory(self, model: str, prompt_tokens: int, chain: Sequence[int]) -> None:
        """Wait until some instance has KV memory for the prompt, or the hold's bound passes."""
        gate, held = self._memory_gate, time.perf_counter()
        released: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        gate.hold(released, prompt_tokens, lambda: self._upstreams.candidates(model), chain)
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for returns a result that came in the same turn as a
            # cancellation, and the request would go upstream for a client that has gone.
            async with asyncio.timeout(gate.max_hold_s):
                await asyncio.shield(released)
        except TimeoutError:
            pass
        finally:
            # No await from here to the decision: a released prompt goes from granted to in flight at once.
            if released.done():
                gate.started(prompt_tokens)
            else:
                released.cancel()
                gate.drop(released)
            self._metrics.memory_hold(model).observe(time.perf_counter() - held)


def _tried(error: OpenAIError, tried: set[str]) -> OpenAIError:
    """error, saying how many instances the request was sent to, as an answer does."""
    error.headers[ATTEMPTS_HEADER] = str(len(tried))
    return error


async def _first_bytes(upstream: aiohttp.ClientResponse, stream: bool) -> bytes:
    """A successful stream's first chunk; otherwise the whole answer (an error's is short), also when a stream
    was asked for and a whole answer came (a gateway in front of the engine), which is relayed whole."""
    if not (stream and upstream.status == 200 and upstream.content_type == "text/event-stream"):
        return await upstream.read()
    first = await upstream.content.readany()
    if not first:  # a 200 stream that ends before its first chunk is broken, not empty
        raise aiohttp.ServerDisconnectedError()
    return first
