"""The conductor: the one way a request is routed, whichever front door it came in by.

`kvroute serve` (router/http/) relays the answer itself; `kvroute epp` (router/epp/) tells a gateway where
to send the request and follows the answer it relays. A door says only how bytes arrive (an Arrival,
router/dispatch/context.py) and how the request is placed; conduct() runs the stages, each once, in order
(their folders under router/dispatch/):

    admit      an admission slot, or a 429 when the router is at capacity (intake/admission.py)
    receive    the body decoded as its API's (router/apis/, a folder each; an agent's as the chat vLLM
               renders), its model checked, the instance a stored response pins it to, its policy taken
               from the routing table in force, its flow and objective
    prepare    its prompt tokenized, hashed and looked up in the index (decide/decision.py)
    wait       it waits in the router, holding no instance, for its turn in flow control and for KV memory
               on some instance, then is looked up again (wait/waiting.py)
    place      the door's: serve sends it (send(): an instance chosen, the request sent, retried elsewhere
               up to its first bytes, place/attempts.py); the endpoint picker picks (pick(): an instance
               chosen and the fallbacks, best first; the gateway sends it)
    observe    what became of it is told by its Outcome (observe/outcome.py), whose end frees the slot
               (leave) and fires room freed, which the waiting stage hears

Any stage that fails leaves the slot and flow control's place at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from router.apis.messages.read import read_messages
from router.apis.openai_body import ChatRequest, CompletionRequest, decode_body, without_full_kv_report
from router.apis.read import AgentRead, read_model_only
from router.apis.responses.history import ResponseHistory
from router.apis.responses.ids import ResponseIds
from router.apis.responses.owners import owner_tag
from router.apis.responses.stored import StoredResponses, response_not_found
from router.apis.routes import Api, presented_key
from router.dispatch.context import Arrival, FlowTicket, Received, Target
from router.dispatch.decide.decision import Decider, Prepared
from router.dispatch.intake.admission import Admission, Overloaded
from router.dispatch.intake.engine_priority import engine_priority, prioritized, with_engine_priority
from router.dispatch.intake.routing_table import RoutingTable
from router.dispatch.observe.observers import Observers
from router.dispatch.observe.outcome import Asked, Outcome, Part
from router.dispatch.observe.routing_headers import forwarded_headers
from router.dispatch.place.attempts import Attempts
from router.dispatch.wait.flow_gate import flow_of, objective_of
from router.dispatch.wait.waiting import Waiting
from router.errors import RETRY_AFTER_S, OpenAIError, model_not_found, too_many_requests, unavailable
from router.prompt.settings import TokenizationConfig
from router.tracing.spans import NULL_TRACING, Trace, Tracing
from router.upstreams.instances import Instance, Upstreams
from scorers.policy import best_first

# What a request for a stored response meets when the instance holding it has gone: vLLM's unknown id instead.
_GONE = frozenset({"no_healthy_instance", "upstream_unreachable"})
# The bodies whose vLLM API takes a `priority` (intake/engine_priority.py)
_ENGINE_PRIORITY = frozenset({"chat", "completion", "responses"})
Placed = TypeVar("Placed")


@dataclass(slots=True)
class Picked:
    """Where a gateway sends a request: the attempt at the chosen instance, and the fallbacks, best first."""

    outcome: Outcome
    fallbacks: tuple[Instance, ...]


@dataclass(frozen=True, slots=True)
class Stages:
    """What carries out the stages: admission, the waiting stage, the decider (prepare, and the decision
    of place), the attempts (serve's place), and the observers an outcome tells."""

    upstreams: Upstreams
    admission: Admission
    waiting: Waiting
    decider: Decider
    attempts: Attempts
    observers: Observers


class Conductor:
    def __init__(
        self,
        stages: Stages,
        table: Callable[[], RoutingTable],
        tokenization: TokenizationConfig,
        tracing: Tracing = NULL_TRACING,
        *,
        keyed_clients: bool = False,
    ) -> None:
        """table: the routing table in force (a reload or PUT /admin/traffic replaces it whole); tracing:
        what starts each request's trace, which both front doors call (router/tracing/); keyed_clients:
        client keys are configured, and a stored response is its creating key's alone."""
        self.upstreams, self.decider, self.observers = stages.upstreams, stages.decider, stages.observers
        self.tracing = tracing
        self._table, self._attempts, self._admission = table, stages.attempts, stages.admission
        self._waiting = stages.waiting
        self._flow_gate = stages.waiting.flow_gate
        self._tokenized_max, self._thread_above = (
            tokenization.max_tokenized_bytes,
            tokenization.thread_above_bytes,
        )
        self.responses = StoredResponses(ResponseIds(stages.upstreams), ResponseHistory())
        self._keyed_clients = keyed_clients

    async def conduct(
        self, arrival: Arrival, place: Callable[[Received, Prepared], Awaitable[Placed]]
    ) -> Placed:
        """The request through every stage, in order, placed by its door (send or pick): what place gives.
        Whatever fails on the way (an OpenAIError, the client leaving) frees the slot and flow control's
        place; once placed, the request holds its slot until its outcome ends (leave)."""
        try:
            await self.admit()
        finally:
            if arrival.admitted is not None:
                arrival.admitted()
        received: Received | None = None
        try:
            received = await self.receive(arrival)
            prepared = await self.prepare(received)
            prepared = await self._waiting.wait(received, prepared)
            return await place(received, prepared)
        except BaseException:
            self.leave(None if received is None else received.ticket)
            raise

    async def admit(self) -> None:
        """Take an admission slot (waiting for one within admission's bounds), or raise a 429."""
        try:
            await self._admission.enter()
        except Overloaded as exc:
            self.observers.metrics.rejected(str(exc)).inc()
            message = "The router is at capacity; retry later."
            raise too_many_requests(message, str(exc), RETRY_AFTER_S) from exc

    def leave(self, ticket: FlowTicket | None = None) -> None:
        """A request that held a slot is over (ticket: its place in flow control, if it had one)."""
        self._admission.leave()
        self._flow_gate.leave(ticket)

    def trace(self, action: str, path: str, stored: str | None, headers: Mapping[str, str]) -> Trace:
        """A request's root span, named by action and its route (a stored response's id as a placeholder,
        so names stay few), continuing the client's trace context."""
        route = path if stored is None else path.replace(stored, "{response_id}", 1)
        return self.tracing.request(f"{action} {route}", headers)

    async def receive(self, arrival: Arrival) -> Received:
        """The body decoded (a 400 in the route's shape when it is not what the route takes), its model
        served (else a 404), its policy chosen by the force header or the traffic split. A large body is
        decoded on a worker thread: an agent's megabytes of tools take a tenth of a second to translate,
        which the event loop spends on everyone else."""
        trace = arrival.trace
        if self.responses.shared is not None and (arrival.api.body == "responses" or arrival.stored):
            await self.responses.recall(arrival.raw, arrival.stored)
        with trace.step("parse"):
            if len(arrival.raw) > self._thread_above:
                received = await asyncio.to_thread(self._received, arrival)
            else:
                received = self._received(arrival)
        trace.parsed(received.model, received.policy.name, received.streamed)
        return received

    def _received(self, arrival: Arrival) -> Received:
        raw, api, headers = arrival.raw, arrival.api, arrival.headers
        read = self._read(raw, api, arrival.stored, arrival.query, headers)
        body = read.body
        if not self.upstreams.serves(body.model):
            raise model_not_found(body.model)
        table = self._table()
        session = headers.get(table.traffic.session_header) or read.session
        policy = table.policy_for(headers.get(table.traffic.force_header), session)
        tokenize = read.tokenize and len(raw) <= self._tokenized_max
        if api.body in ("chat", "completion"):
            raw = without_full_kv_report(raw, body.vllm_xargs)
        flow_control = self._flow_gate.config
        flow = flow_of(flow_control, headers, session)
        objective = objective_of(flow_control, headers)
        body_for = read.body_for
        if flow_control.engine_priority and api.body in _ENGINE_PRIORITY:
            priority = engine_priority(flow_control.objective(objective)[1].priority)
            named = body.priority is not None
            if body_for is None:
                raw = with_engine_priority(raw, priority, named)
            else:
                body_for = prioritized(body_for, priority, named)
        off_loop = len(raw) > self._thread_above
        target = Target(api.name, read.pinned, read.pinned_by, body_for, read.watch, api.get)
        headers = forwarded_headers(headers)
        return Received(
            body,
            policy,
            session,
            raw,
            headers,
            tokenize,
            off_loop,
            target,
            flow,
            objective,
            trace=arrival.trace,
        )

    def _read(
        self, raw: bytes, api: Api, stored: str | None, query: str, headers: Mapping[str, str]
    ) -> AgentRead:
        only = self.upstreams.only_model()
        kind = api.body
        if kind == "chat":
            chat = decode_body(raw, ChatRequest, only)
            return AgentRead(chat, chat.user)
        if kind == "completion":
            completion = decode_body(raw, CompletionRequest, only)
            return AgentRead(completion, completion.user)
        if kind == "responses":
            return self.responses.read(raw, only, self._owner(headers))
        if kind == "messages":
            return read_messages(raw, only, self.decider.anthropic_probes)
        if stored is not None:
            return self.responses.read_stored(stored, query, only, self._owner(headers))
        return read_model_only(raw, only)

    def _owner(self, headers: Mapping[str, str]) -> str | None:
        """The tag of the client's key that stored responses are scoped to; None without client keys."""
        return owner_tag(presented_key(headers)) if self._keyed_clients else None

    async def prepare(self, received: Received) -> Prepared:
        """The prompt's token ids, blocks and matches in the index."""
        return await self.decider.prepare(
            received.body, received.session, received.tokenize, received.off_loop, received.trace
        )

    async def send(self, received: Received, prepared: Prepared, path: str) -> Outcome:
        """Sent to the best instance with room, retried elsewhere while the client has had nothing: the
        outcome whose first bytes came (router/dispatch/place/attempts.py). A request for a stored response
        whose instance is gone gets vLLM's answer for an id it does not hold."""
        target = received.target
        try:
            outcome = await self._attempts.send(received, prepared, path)
            outcome.ticket = received.ticket
            return outcome
        except OpenAIError as error:
            self.observers.request_ended(received.policy, error.code)
            if target.pinned_by is None or error.code not in _GONE:
                raise
            raise response_not_found(target.pinned_by) from error

    def pick(
        self, received: Received, prepared: Prepared, outside: frozenset[str] | None, fallbacks: int
    ) -> Picked:
        """The best instance with room but those outside (the gateway's subset hint leaves them out; None:
        it gave none), its attempt started, and up to fallbacks others, best first."""
        policy = received.policy
        target = received.target
        try:
            candidates = self._attempts.candidates(prepared, outside or frozenset(), target.pinned)
            if not candidates and target.pinned_by is not None:
                raise response_not_found(target.pinned_by)
            if not candidates:
                code = "no_healthy_instance" if outside is None else "no_instance_in_subset"
                message = f"No healthy instance serves `{received.model}` right now. Retry later."
                raise unavailable(message, code, RETRY_AFTER_S)
        except OpenAIError as error:
            self.observers.request_ended(policy, error.code)
            raise
        decision, scores = self.decider.decide_scored(prepared, policy, candidates, received.trace)
        others: tuple[Instance, ...] = ()
        if fallbacks and len(candidates) > 1:
            order = best_first(scores)
            others = tuple(candidates[i] for i in order if candidates[i] is not decision.instance)[:fallbacks]
        if target.body_for is not None:  # the body names the chosen instance: no other may serve it
            others = ()
        asked = Asked(policy, received.model, received.streamed, target.api)
        outcome = Outcome.start(self.observers, decision, asked, None)
        outcome.watch = target.watch
        outcome.ticket = received.ticket
        return Picked(outcome, others)

    def moved(self, outcome: Outcome, prepared: Prepared, served: Instance, skipped: int) -> Outcome:
        """The gateway could not reach outcome's instance and served the request from served, a fallback
        after skipped others: the first attempt failed, and the one at served is the request's."""
        outcome.abandon(None, failed=True, admitted=False, withdraw=True)
        decision = self.decider.decide(prepared, outcome.policy, [served])
        attempts = outcome.attempts + 1 + skipped
        moved = Outcome.start(self.observers, decision, outcome.asked, outcome.first_sent, Part(), attempts)
        moved.ticket = outcome.ticket
        return moved
