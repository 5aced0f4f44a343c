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

import msgspec

from router.dispatch.context import Received
from router.dispatch.decide.decision import Decision, Prepared
from router.dispatch.observe.outcome import WHOLE, Asked, Outcome, Part
from router.dispatch.place.prefill_leg import NoPrefill, PrefillLeg, Transfer, decode_leg_body
from router.dispatch.place.sending import Outgoing, SendContext, Sent
from router.dispatch.place.settings import DisaggregationConfig
from router.dispatch.place.verdict import Failure, Verdict, judge, none_answered, with_attempts
from router.dispatch.place.warm_up import WarmUpSender
from router.errors import RETRY_AFTER_S, OpenAIError, too_many_requests
from router.upstreams.instances import Instance

log = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class _Tries:
    """One request's attempts so far."""

    tried: set[str] = field(default_factory=set)
    # Of the instances that passed it on, the last of each kind's error (router/dispatch/place/verdict.py)
    failures: dict[Failure, OpenAIError] = field(default_factory=dict)
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
            candidates = self.candidates(prepared, frozenset(tries.tried), target.pinned)
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
            verdict = self._settled(sent, outcome, attempt, tries, stream)
            if verdict.serves:
                outcome.turn_answered = self._warm_up.follow(received, prepared, path)
                return outcome
            span.end()
            if verdict.back_off:
                await self._retry.back_off(len(tries.tried))
        raise none_answered(model, tries.tried, tries.failures)

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
            transfer = tries.transfer or await self._prefill.transfer_for(
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

    def _settled(self, sent: Sent, outcome: Outcome, attempt: int, tries: _Tries, stream: bool) -> Verdict:
        """What came of the attempt, judged (router/dispatch/place/verdict.py) and carried out: the outcome
        answered, or abandoned and counted; the OpenAIError that ends the request, raised."""
        instance, name = outcome.instance, outcome.instance.name

        def may_retry() -> bool:
            return self._may_retry(outcome.model, attempt, tries.tried | {name})

        verdict = judge(sent, name, stream, may_retry)
        if not verdict.serves:
            self._passed_on(verdict, instance, tries)  # marked down first, so that the room freed avoids it
            outcome.abandon(sent.upstream, verdict.failed, verdict.admitted, verdict.withdraw)
            if verdict.ends is not None:
                raise with_attempts(verdict.ends, tries.tried | {name}) from sent.error
            return verdict
        assert sent.upstream is not None
        try:
            outcome.answered(sent.upstream, sent.first, attempts=len(tries.tried) + 1)
        except BaseException:
            outcome.abandon(sent.upstream, failed=False)
            raise
        return verdict

    def _passed_on(self, verdict: Verdict, instance: Instance, tries: _Tries) -> None:
        """The instance did not serve the client: counted against it, and, unless the request ends, left out
        of the next attempts."""
        name = instance.name
        if verdict.counted is not None:
            self._metrics.upstream_errors(name, verdict.counted).inc()
        if verdict.unreachable:
            self._context.health.mark_unreachable(instance)
        if verdict.ends is not None:
            return
        tries.tried.add(name)
        if verdict.failure is not None:
            kind, error = verdict.failure
            tries.failures[kind] = error
        if verdict.lost_transfer:
            tries.transfer = None
        if verdict.retried:
            self._metrics.retries(name).inc()

    def candidates(
        self, prepared: Prepared, exclude: frozenset[str] = frozenset(), pinned: Instance | None = None
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
