"""What became of one attempt at one instance, told to every part that learns from it, from one place.

An attempt starts (the instance counts it in flight, its circuit breaker may take it as a probe), may see its
first byte (the TTFT model and the A/B statistics learn), and ends once: finished (answered, refused, broken
or cut) or abandoned before the client had anything (the instance failed or the client left). Each of those
updates the instance's counters, its breaker, the metrics and the A/B statistics here, and nowhere else; a
decision served or withdrawn is told to those subscribed (router/dispatch/observe/observers.py: the decider's
session placements and its index's speculative entries), which this module does not know.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol

from router.dispatch.context import FlowTicket
from router.dispatch.decide.decision import Decision
from router.dispatch.observe.ab import Ended
from router.dispatch.observe.observers import Observers, Served
from router.dispatch.observe.usage import Usage, answer_usage
from router.upstreams.instances import Instance
from router.upstreams.peer_sync import NUDGE_CONTEXT_TOKENS
from scorers.policy import Policy

log = logging.getLogger(__name__)

BUSY = 503  # refused before anything ran: not a failure of the instance
# What an attempt is of its request: all of it, or one leg of a disaggregated one (the decode leg answers the
# client, as a whole request does; the prefill leg's answer is the router's only).
Leg = Literal["whole", "prefill", "decode"]
# unsplit: an API the prefill leg cannot serve (the agents'), routed whole to a decode instance
PdPath = Literal["disaggregated", "skipped", "fallback", "unsplit"]
_CLIENT_CLOSED = 499  # nginx's code for a client that left before its answer ended


class Answer(Protocol):
    """What an outcome reads of an instance's answer: aiohttp's response here, or the status a gateway that
    relays the answer itself reports (router/epp/)."""

    @property
    def status(self) -> int: ...

    def release(self) -> object: ...

    def close(self) -> None: ...


class Asked(NamedTuple):
    """What the client asked, as every attempt at it counts it: the policy routing it, the model as the
    client named it (a configured model: the metrics' label values stay few), whether streamed, its API."""

    policy: Policy
    model: str
    streamed: bool
    api: str = "chat"  # the metrics' label


class Part(NamedTuple):
    """What an attempt is of its request, and, of a disaggregated model's, how the request was served."""

    leg: Leg = "whole"
    pd_path: PdPath | None = None


WHOLE = Part()


@dataclass(eq=False)
class Prefill:
    """A request's uncached prompt tokens, queued in its instance's prefill count until the engine is past
    them: at the first byte, when the predicted TTFT of a whole answer passes, or at the end at the latest."""

    instance: Instance
    tokens: int
    freed: Callable[[], None]  # told once tokens were queued and no longer are

    def take(self) -> int:
        """The tokens still queued, from now on not (0 once taken)."""
        tokens, self.tokens = self.tokens, 0
        return tokens

    def retire(self) -> None:
        tokens = self.take()
        if tokens:
            self.instance.prefill_done(tokens)
            self.freed()


@dataclass(eq=False)  # kept in a set by identity
class Outcome:
    observers: Observers
    decision: Decision
    policy: Policy
    model: str  # as the client named it (a configured model: the metrics' label values stay few)
    streamed: bool
    api: str  # the metrics' label
    started: float  # this attempt: what the instance's TTFT model learns from
    first_sent: float  # the first attempt: what the client waited, for the policy's metrics
    prefill: Prefill
    probe: bool  # the instance's half-open circuit breaker let it through as its probe
    upstream: Answer | None = None  # once the instance answered
    first: bytes = b""  # a stream's first chunk, or the whole answer
    attempts: int = 1
    ticket: FlowTicket | None = None  # its place in flow control's counts
    leg: Leg = "whole"
    pd_path: PdPath | None = None  # how a disaggregated model's request was served
    finished: bool = False
    # How it ended, set by the verbs below: the stream from upstream broke off; the engine's stream carried an
    # error event (it failed mid-way); ended by the router (shutting down), not by the instance; relayed to
    # its end (a stream not broken, cut, nor left by its client).
    _broken: bool = False
    _engine_error: bool = False
    _cut: bool = False
    _completed: bool = False
    _first_byte_s: float | None = None  # a stream's time to its first byte (a whole answer's comes last)
    prefill_instance: str | None = None  # a decode leg's: where its prompt's KV was computed
    prefill_cached_tokens: int | None = None  # what the prefill leg's answer reports it found cached
    # Shown a successful answer: whole, or each run of whole stream events (a stored response's output)
    watch: Callable[[bytes], None] | None = None
    # Told the instance that answered once a program's turn was answered (router/dispatch/place/warm_up.py)
    turn_answered: Callable[[Instance], None] | None = None

    @classmethod
    def start(
        cls,
        observers: Observers,
        decision: Decision,
        asked: Asked,
        first_sent: float | None,
        part: Part = WHOLE,
        attempts: int = 1,
    ) -> Outcome:
        """Count the attempt against its instance, as it is sent. first_sent: when the request's first
        attempt was (None: this is it); attempts: this one's number."""
        instance = decision.instance
        probe = instance.breaker.sent()
        instance.start(decision.prompt_tokens, decision.uncached_tokens, decision.chain)
        if decision.prompt_tokens >= NUDGE_CONTEXT_TOKENS and observers.sent_large is not None:
            observers.sent_large()
        metrics = observers.metrics
        metrics.in_flight(instance.name).set(instance.own_in_flight)
        metrics.ttft_predicted(instance.name).observe(decision.predicted_ttft_s)
        started = observers.clock()
        prefill = Prefill(instance, decision.uncached_tokens, observers.room_freed.fire)
        if not asked.streamed and prefill.tokens:
            # A whole answer's first byte comes with its last: its prefill retires when the instance's TTFT
            # model expects the first token instead (an engine answers whole only at the end).
            asyncio.get_running_loop().call_later(decision.predicted_ttft_s, prefill.retire)
        first = started if first_sent is None else first_sent
        leg, pd_path = part
        return cls(
            observers,
            decision,
            *asked,
            started,
            first,
            prefill,
            probe,
            attempts=attempts,
            leg=leg,
            pd_path=pd_path,
        )

    @property
    def asked(self) -> Asked:
        """What the client asked, for another attempt at it."""
        return Asked(self.policy, self.model, self.streamed, self.api)

    @property
    def instance(self) -> Instance:
        return self.decision.instance

    @property
    def status(self) -> int:
        return 0 if self.upstream is None else self.upstream.status

    @property
    def cut(self) -> bool:
        """Ended by the router (shutting down), not by the instance."""
        return self._cut

    @property
    def broken(self) -> bool:
        return self._broken

    @property
    def engine_error(self) -> bool:
        return self._engine_error

    @property
    def completed(self) -> bool:
        return self._completed

    def cut_off(self) -> None:
        """The router ends it (shutting down): the instance is not to blame."""
        self._cut = True

    def broke(self) -> None:
        """The stream from the instance broke off (or was cut under its read)."""
        self._broken = True

    def engine_failed(self) -> None:
        """The engine's stream reported its own failure (an error event)."""
        self._engine_error = True

    def complete(self) -> None:
        """Relayed to its end: a stream not broken, cut nor left by its client, or a whole answer in hand."""
        self._completed = True

    def completed_whole(self, payload: bytes) -> None:
        """A whole answer went through: its usage tells the tokens it generated (the TTFT model's sample) and
        those the engine found cached (the A/B's engine-observed hits)."""
        if self.watch is not None and self.status == 200 and payload:
            self.watch(payload)
        self.completed_with(answer_usage(payload) if payload else None)

    def completed_with(self, usage: Usage | None) -> None:
        """A whole answer went through, with this usage (None: it had none, or it was not read)."""
        if not self.streamed:  # a stream's first byte was taken when it came (even if not a stream)
            self.first_byte(None if usage is None else usage.completion_tokens)
        if usage is not None and usage.prompt_tokens_details is not None:
            self.observed_cache(usage.prompt_tokens, usage.cached_tokens or 0)
        self.complete()

    @property
    def for_client(self) -> bool:
        """Whether this attempt's answer is the client's (a prefill leg's is not)."""
        return self.leg != "prefill"

    def answered(self, upstream: Answer, first: bytes, attempts: int) -> None:
        """The instance answered: this attempt serves the client (or, a prefill leg, its decode leg). A
        stream's first byte is here."""
        self.upstream, self.first, self.attempts = upstream, first, attempts
        if self.for_client:
            observers, decision = self.observers, self.decision
            observers.served.tell(Served(decision, self.policy))
            if decision.request is not None:
                observers.programs.turn_started(decision.request, decision.instance.name, self.first_sent)
            if self.pd_path is not None:
                self.observers.metrics.pd_requests(self.model, self.pd_path).inc()
        if self.streamed:
            self.first_byte()

    def transferred(self, prefill_instance: str, cached_tokens: int | None) -> None:
        """A decode leg's prefill leg is done: its KV is ready to fetch, and the decode leg's time starts."""
        self.prefill_instance, self.pd_path = prefill_instance, "disaggregated"
        self.prefill_cached_tokens = cached_tokens
        self.started = self.observers.clock()

    def first_byte(self, decoded_tokens: int | None = None) -> None:
        """decoded_tokens: for a whole answer, how many tokens it generated (None: unknown). Its prefill
        retires once the instance's TTFT model has learnt from it: the room that frees is judged by that
        model's queue rate (router/dispatch/wait/saturation.py)."""
        try:
            self._learn_first_byte(decoded_tokens)
        finally:
            self.prefill.retire()

    def _learn_first_byte(self, decoded_tokens: int | None) -> None:
        """Only answers (200) count as TTFT samples: an error comes back fast and would flatter its
        policy."""
        if self.status != 200:
            return
        now = self.observers.clock()
        waited, elapsed = now - self.first_sent, now - self.started
        metrics, policy = self.observers.metrics, self.policy.name
        decision, name = self.decision, self.instance.name
        if self.for_client:
            metrics.ttft(policy, self.model).observe(waited)
            self.observers.ab_for(self.policy).first_byte(policy, waited, decision.session_key)
        if self.leg != "whole":
            metrics.pd_leg(self.leg, name).observe(elapsed)
        model = self.instance.ttft_model
        if self.streamed:
            self._first_byte_s = elapsed
            model.observe(decision.features, elapsed)
            metrics.ttft_observed(name).observe(elapsed)
            metrics.ttft_error(name).observe(elapsed - decision.predicted_ttft_s)
        elif decoded_tokens is not None:
            model.observe(decision.features._replace(decoded_tokens=decoded_tokens), elapsed)
        else:
            return
        if model.solved == model.observations:  # the rates just changed
            for term, rate in model.rates.items():
                metrics.ttft_rate(name, term).set(rate)
            metrics.ttft_slowdown(name).set(model.slowdown)

    def observed_cache(self, prompt_tokens: int, cached_tokens: int) -> None:
        """The engine's own count of the prompt tokens it had cached (a whole answer's usage)."""
        self.observers.ab_for(self.policy).observed_cache(self.policy.name, prompt_tokens, cached_tokens)

    def abandon(
        self,
        upstream: Answer | None,
        failed: bool = True,
        admitted: bool = True,
        withdraw: bool = False,
    ) -> None:
        """The attempt never reached the client: free what it held. failed: count it against the instance's
        circuit breaker; admitted: the engine may have held its context (it was sent); withdraw: the engine
        computed nothing of it, or lost it, so its speculative blocks go."""
        if upstream is not None:
            upstream.close()  # not released to the pool: the engine must see the connection go (abort)
        self._end(admitted)
        if failed:
            self._breaker_failed()
        else:
            self.instance.breaker.abandoned(self.probe)
        if withdraw:
            self.observers.withdrawn.tell(self.decision)

    def finish(self) -> bool:
        """The answer ended, whole, broken, cut or left by its client; False when it had already."""
        if self.finished or self.upstream is None:
            return False
        self.finished = True
        self.upstream.release()
        status = self.upstream.status
        self._end(admitted=status == 200)
        if status >= 400:  # refused or failed: the engine computed nothing of it
            self.observers.withdrawn.tell(self.decision)
        # A stream that ended neither whole, broken nor cut by the router was left by its client mid-way: its
        # time is not an answer's, and it says nothing of the instance.
        left = self.streamed and status == 200 and not (self.completed or self.broken or self.cut)
        failed = self.broken or self.engine_error
        if (failed and not self.cut) or (status >= 500 and status != BUSY):
            self._breaker_failed()
        elif self.cut or left or status >= 400:
            # Ended by the router or the client, or the client's mistake: nothing learnt about the instance.
            self.instance.breaker.abandoned(self.probe)
        else:
            self._breaker_succeeded()
        if not self.for_client:
            return True
        decision = self.decision
        self.observers.programs.turn_ended(decision.session_key)
        if self.turn_answered is not None and status == 200 and self.completed and not failed:
            self.turn_answered(self.instance)
        if decision.request is not None:
            self.policy.responded(decision.request, self.instance, self._first_byte_s, status)
        if left:
            status = _CLIENT_CLOSED
        metrics, policy = self.observers.metrics, self.policy.name
        metrics.requests(policy, self.instance.name, str(status), self.model, self.api).inc()
        elapsed = self.observers.clock() - self.first_sent
        answered = status == 200 and not failed
        if answered:
            metrics.e2e(policy, self.model).observe(elapsed)
        ended = Ended(
            self.instance.name,
            502 if failed else status,
            elapsed if answered else None,
            decision.prompt_tokens,
            # what the answering instance reused: a decode leg's fetched tokens are not
            decision.prompt_tokens - decision.uncached_tokens - decision.features.transferred_tokens,
            self.prefill_instance,
            self.pd_path,
        )
        self.observers.ab_for(self.policy).finished(policy, ended)
        return True

    def _end(self, admitted: bool) -> None:
        instance, decision = self.instance, self.decision
        instance.end(decision.prompt_tokens, self.prefill.take(), admitted, decision.chain)
        self.observers.metrics.in_flight(instance.name).set(instance.own_in_flight)
        self.observers.room_freed.fire()

    def _breaker_failed(self) -> None:
        instance = self.instance
        if instance.breaker.failed(self.probe):
            failures = instance.breaker.failures
            log.warning("circuit breaker for %s opened after %d failures in a row", instance.name, failures)
            self.observers.metrics.circuit_opens(instance.name).inc()
            self.observers.metrics.circuit_open(instance.name).set(1)

    def _breaker_succeeded(self) -> None:
        instance = self.instance
        if self.probe:
            log.info("circuit breaker for %s closed: a probe request succeeded", instance.name)
        instance.breaker.succeeded(self.probe)
        if instance.breaker.opened_at is None:
            self.observers.metrics.circuit_open(instance.name).set(0)
