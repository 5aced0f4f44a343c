"""Send: choose an instance, send the request, and try another while the client has had nothing yet.

Until the first bytes of an answer (a stream's first chunk, a whole answer) reach the client, an instance
that cannot be reached, drops the connection, refuses the router's key or is busy may be replaced by another,
within the attempts and the retry budget. Each attempt's outcome is told to the rest of the router by
router/dispatch/observe/outcome.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from router.dispatch.context import Received
from router.dispatch.decide.decision import Decision, Prepared
from router.dispatch.observe.outcome import BUSY, WHOLE, Asked, Outcome, Part
from router.dispatch.observe.routing_headers import ATTEMPTS_HEADER
from router.dispatch.place.failures import REFUSED_CREDENTIALS
from router.dispatch.place.prefill_leg import NoPrefill, PrefillLeg, Transfer, decode_leg_body
from router.dispatch.place.sending import Outgoing, SendContext, Sent
from router.dispatch.place.settings import DisaggregationConfig
from router.dispatch.place.warm_up import WarmUpSender
from router.errors import (
    RETRY_AFTER_S,
    OpenAIError,
    too_many_requests,
    unavailable,
    upstream_failed,
    upstream_redirected,
    upstream_timeout,
    upstream_unauthorized,
)
from router.upstreams.instances import Instance
from scorers.policy import Policy

log = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class _Tries:
    """One request's attempts so far."""

    tried: set[str] = field(default_factory=set)
    dropped: tuple[str, Exception] | None = None  # the last instance that broke off unanswered
    refused: tuple[str, int] | None = None  # the last instance that refused the router's key
    redirected: tuple[str, int, str] | None = None  # the last instance that answered a redirect, and where
    first_sent: float | None = None  # the client's wait includes the attempts that failed
    transfer: Transfer | None = None  # a prefill leg's KV that the next decode leg may still fetch
    body: dict[str, Any] | None = None  # the client's, decoded once a disaggregated leg needs it


class Attempts:
    def __init__(
        self,
        context: SendContext,
        disaggregation: DisaggregationConfig | None = None,
        warm_up: bool = False,
    ) -> None:
        """disaggregation: how disaggregated models' prefill legs go (router/dispatch/place/prefill_leg.py);
        warm_up: programs' next turns are warmed up (router/dispatch/place/warm_up.py)."""
        self._context = context
        self._upstreams, self._decider, self._observers = (
            context.upstreams,
            context.decider,
            context.observers,
        )
        self._metrics, self._retry = context.observers.metrics, context.retry
        disaggregation = disaggregation or DisaggregationConfig()
        self._prefill = PrefillLeg(context, disaggregation.connector, disaggregation.local_prefill_max_tokens)
        self._warm_up = WarmUpSender(context, warm_up)

    async def send(self, received: Received, prepared: Prepared, path: str) -> Outcome:
        """Send to the best instance and wait for the first bytes of its answer: the outcome that serves the
        client, or an OpenAIError saying why none could. The request's trace gets a span for each attempt
        (the one that answers ends with the answer, router/tracing/)."""
        model, target, trace, stream = received.model, received.target, received.trace, received.streamed
        tries = _Tries()
        self._retry.earn()
        for attempt in range(self._retry.attempts):
            candidates = self.candidates(prepared, received.policy, frozenset(tries.tried), target.pinned)
            if not candidates:
                break
            outcome, payload = await self._start(received, prepared, path, candidates, tries)
            span = trace.attempt(outcome.instance, attempt, outcome.leg)
            try:
                method = "GET" if target.get else "POST"
                outgoing = Outgoing(outcome.instance, path, payload, span.headers(received.headers), method)
                sent = await self._context.sender.attempt(outgoing, stream)
            except BaseException:
                outcome.abandon(None, failed=False)
                raise
            span.sent(sent.kind, 0 if sent.upstream is None else sent.upstream.status)
            if await self._answered(sent, outcome, attempt, tries, stream):
                outcome.turn_answered = self._warm_up.follow(received, prepared, path)
                return outcome
            span.end()
        raise self._none_answered(model, received.policy, tries)

    async def _start(
        self, received: Received, prepared: Prepared, path: str, candidates: list[Instance], tries: _Tries
    ) -> tuple[Outcome, bytes]:
        """The attempt at the best candidate, started, and what it sends: the client's body, or a decode
        leg's once its prefill leg computed the prompt elsewhere."""
        policy, target, raw = received.policy, received.target, received.raw
        decision = self._decider.decide(prepared, policy, candidates, received.trace)
        model = prepared.request.model
        part = self._part(model, decision, tries.transfer, target.splits)
        sent_decision = self._decider.decode_leg(decision) if part.leg == "decode" else decision
        observers = self._observers
        asked = Asked(policy, model, received.streamed, target.api)
        outcome = Outcome.start(observers, sent_decision, asked, tries.first_sent, part)
        outcome.watch = target.watch
        tries.first_sent = outcome.first_sent
        if part.leg != "decode":
            return outcome, raw if target.body_for is None else target.body_for(decision.instance)
        body = tries.body = msgspec.json.decode(raw) if tries.body is None else tries.body
        try:
            transfer = tries.transfer or await self._prefill.run(
                received, prepared, path, body, decision.instance.name
            )
        except NoPrefill as exc:
            # The decode instance computes the prompt itself: a whole request, as aggregated.
            log.debug("no prefill leg: %s", exc)
            outcome.abandon(None, failed=False, admitted=False)
            whole = Outcome.start(observers, decision, asked, tries.first_sent, Part(pd_path="fallback"))
            return whole, raw
        except BaseException:  # the client left, or the prefill leg timed out
            outcome.abandon(None, failed=False, admitted=False, withdraw=True)
            raise
        tries.transfer = transfer
        outcome.transferred(transfer.instance.name, transfer.cached_tokens)
        return outcome, decode_leg_body(body, transfer)

    async def _answered(
        self, sent: Sent, outcome: Outcome, attempt: int, tries: _Tries, stream: bool
    ) -> bool:
        """Whether the attempt answers the client; False: try another instance; or the OpenAIError that ends
        the request."""
        instance, upstream, policy = outcome.instance, sent.upstream, outcome.policy
        metrics, model = self._metrics, outcome.model
        if sent.kind == "not_connected":
            # Nothing was sent: safe to try another instance, and this one is down for now.
            outcome.abandon(upstream, admitted=False, withdraw=True)
            tries.tried.add(instance.name)
            metrics.upstream_errors(instance.name, "connect").inc()
            self._context.health.mark_unreachable(instance)
            return False
        if sent.kind == "dropped":
            # Sent, but the connection broke before the first byte (the instance died or restarted, or closed
            # a kept-alive connection as it was reused): the client has had nothing yet, so another instance
            # may serve it, within the retry budget. One drop does not mark the instance down (a request
            # every engine drops would black out the model): its circuit breaker counts it, and a dead
            # instance refuses the next connection. What it computed before dying went with it.
            assert isinstance(sent.error, Exception)
            outcome.abandon(upstream, withdraw=True)
            tries.tried.add(instance.name)
            metrics.upstream_errors(instance.name, "disconnected").inc()
            tries.dropped = instance.name, sent.error
            tries.transfer = None  # it may have fetched the KV, which the prefill instance then let go
            if not self._may_retry(model, attempt, tries.tried):
                self._observers.request_failed(policy)
                raise _tried(upstream_failed(instance.name, sent.error), tries.tried) from sent.error
            metrics.retries(instance.name).inc()
            await self._retry.back_off(len(tries.tried))
            return False
        if sent.kind in ("timed_out", "bad_answer"):
            # Timed out or answered badly: it may still be running there, so it is not sent again.
            assert sent.error is not None
            outcome.abandon(upstream)
            timed_out = sent.kind == "timed_out"
            metrics.upstream_errors(instance.name, "timeout" if timed_out else "response").inc()
            self._observers.request_failed(policy)
            tried = tries.tried | {instance.name}
            if timed_out:
                limit = "first_byte_timeout_s" if stream else "response_timeout_s"
                raise _tried(upstream_timeout(instance.name, limit), tried) from sent.error
            raise _tried(upstream_failed(instance.name, sent.error), tried) from sent.error
        assert upstream is not None
        return self._taken(upstream, sent.first, outcome, attempt, tries)

    def _taken(
        self, upstream: aiohttp.ClientResponse, first: bytes, outcome: Outcome, attempt: int, tries: _Tries
    ) -> bool:
        """An answer came: it is the client's, unless the instance refused the router's key or was busy."""
        instance, metrics = outcome.instance, self._metrics
        if upstream.status in REFUSED_CREDENTIALS:
            # The router's key (clients' never reach engines), which vLLM checks before anything else: nothing
            # ran, and another instance may take it. Counted against this one's breaker.
            tries.refused = instance.name, upstream.status
            return self._passed_on(upstream, outcome, tries, "unauthorized")
        if 300 <= upstream.status < 400:
            # Not followed: what the instance's URL leads to is no instance the index and the load accounting
            # know (an ingress redirecting to https, a moved host), and aiohttp would send a 301's or 302's
            # POST on as a GET. Nothing ran; another instance may take it. Counted against its breaker.
            tries.redirected = instance.name, upstream.status, upstream.headers.get("Location", "")
            return self._passed_on(upstream, outcome, tries, "redirect")
        if upstream.status == BUSY and self._may_retry(outcome.model, attempt, tries.tried | {instance.name}):
            # vLLM's admission control (--max-num-queued-reqs, --max-num-queued-tokens) and a fleet being
            # scaled refuse with 503 before anything runs, asking for "a different instance". The last
            # instance's 503 reaches the client, with its Retry-After.
            metrics.retries(instance.name).inc()
            return self._passed_on(upstream, outcome, tries, "busy", failed=False)
        try:
            outcome.answered(upstream, first, attempts=len(tries.tried) + 1)
        except BaseException:
            outcome.abandon(upstream, failed=False)
            raise
        return True

    def _passed_on(
        self,
        upstream: aiohttp.ClientResponse,
        outcome: Outcome,
        tries: _Tries,
        kind: str,
        failed: bool = True,
    ) -> bool:
        """The instance answered that nothing ran: the request goes to another (False: not the client's);
        kind: the upstream error counted; failed: counted against its breaker too."""
        outcome.abandon(upstream, failed=failed, admitted=False, withdraw=True)
        tries.tried.add(outcome.instance.name)
        self._metrics.upstream_errors(outcome.instance.name, kind).inc()
        return False

    def _none_answered(self, model: str, policy: Policy, tries: _Tries) -> OpenAIError:
        """Why no instance answered, once none is left to try."""
        if tries.dropped is not None:
            self._observers.request_failed(policy)
            return _tried(upstream_failed(*tries.dropped), tries.tried)
        if tries.refused is not None:
            self._observers.request_failed(policy)
            return _tried(upstream_unauthorized(*tries.refused), tries.tried)
        if tries.redirected is not None:
            self._observers.request_failed(policy)
            return _tried(upstream_redirected(*tries.redirected), tries.tried)
        if tries.tried:
            message, code = f"No instance serving `{model}` could be reached.", "upstream_unreachable"
        else:
            message, code = f"No healthy instance serves `{model}` right now.", "no_healthy_instance"
        self._observers.request_rejected(policy, code)
        return _tried(unavailable(message + " Retry later.", code, RETRY_AFTER_S), tries.tried)

    def candidates(
        self,
        prepared: Prepared,
        policy: Policy,
        exclude: frozenset[str] = frozenset(),
        pinned: Instance | None = None,
    ) -> list[Instance]:
        """The healthy instances serving the request's model (pinned: that one alone, if it is healthy), but
        those in exclude, that have room for one more request of this router (router/upstreams/filters.py);
        a 429 when every healthy one is full."""
        model = prepared.request.model
        if pinned is None:
            healthy = self._upstreams.candidates(model, exclude=exclude)
        else:
            healthy = [pinned] if pinned.healthy and pinned.name not in exclude else []
        candidates = self._context.room.filter(prepared.request, healthy)
        if healthy and not candidates:
            self._observers.request_rejected(policy, "instances_full")
            raise too_many_requests(
                f"Every instance serving `{model}` is at capacity; retry later.",
                "instances_full",
                RETRY_AFTER_S,
            )
        return candidates

    def _part(self, model: str, decision: Decision, transfer: Transfer | None, splits: bool) -> Part:
        """What the attempt at decision's instance is: a whole request (and, of a disaggregated model, why)
        or the decode leg after a prefill leg (done already when transfer is one still to fetch)."""
        if not self._upstreams.disaggregated(model):
            return WHOLE
        if not splits:
            return Part(pd_path="unsplit")
        if transfer is not None or self._prefill.worth_it(decision):
            return Part("decode")
        return Part(pd_path="skipped")

    def _may_retry(self, model: str, attempt: int, tried: set[str]) -> bool:
        limit = self._context.room.per_instance_limit
        others = self._upstreams.candidates(model, exclude=frozenset(tried))
        return self._retry.may_retry(attempt, any(other.own_in_flight < limit for other in others))


def _tried(error: OpenAIError, tried: set[str]) -> OpenAIError:
    """error, saying how many instances the request was sent to, as an answer does."""
    error.headers[ATTEMPTS_HEADER] = str(len(tried))
    return error
