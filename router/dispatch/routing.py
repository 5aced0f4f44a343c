"""The routing service: the one way a request is routed, whichever front door it came in by.

`kvroute serve` (router/http/) relays the answer itself; `kvroute epp` (router/epp/) tells a gateway where
to send the request and follows the answer it relays. They differ only in how bytes move. Both call, in order:

    admit()            an admission slot, or a 429 when the router is at capacity
    receive(...)       the body decoded as its API's (router/dispatch/apis.py; an agent's as the chat vLLM
                       renders, router/dispatch/agent_bodies.py), its model checked, the instance a stored
                       response pins it to, its policy taken from the routing table in force, its flow
                       and objective
    prepare(...)       its prompt tokenized, hashed and looked up in the index
    wait_turn(...)     flow control: it waits in the router, holding no instance, while every instance
                       that could serve it is saturated, then is looked up again
                       (router/dispatch/flow_gate.py)
    send(...)          serve: an instance chosen, the request sent, retried elsewhere up to its first bytes
    pick(...)          epp: an instance chosen, and the fallbacks, best first; the gateway sends it
    leave(ticket)      the slot is free again, when the request's Outcome has ended

What became of the request is told by its Outcome (router/dispatch/outcome.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from router.config import TokenizationConfig
from router.dispatch.admission import Admission, Overloaded
from router.dispatch.agent_bodies import (
    AgentRead,
    StoredResponses,
    read_messages,
    read_model_only,
    response_not_found,
)
from router.dispatch.apis import Api
from router.dispatch.attempts import Attempts, Target
from router.dispatch.decision import Decider, Prepared, uncached_at_best
from router.dispatch.flow_gate import FlowGate, FlowTicket, flow_of, objective_of
from router.dispatch.outcome import Observers, Outcome
from router.dispatch.response_history import ResponseHistory
from router.dispatch.response_ids import ResponseIds
from router.dispatch.response_owners import owner_tag, presented_key
from router.dispatch.routing_headers import forwarded_headers
from router.dispatch.routing_table import RoutingTable
from router.errors import RETRY_AFTER_S, OpenAIError, model_not_found, too_many_requests, unavailable
from router.prompt.openai_body import ChatRequest, CompletionRequest, decode_body, without_full_kv_report
from router.tracing.spans import NULL_TRACE, NULL_TRACING, Trace, Tracing
from router.upstreams.instances import Instance, Upstreams
from scorers.policy import Policy, best_first

# What a request for a stored response meets when the instance holding it has gone: vLLM's unknown id instead.
_GONE = frozenset({"no_healthy_instance", "upstream_unreachable"})


@dataclass(slots=True)  # not frozen: one is made per request, and a frozen one's __init__ costs 4x
class Received:
    """A request as the router routes it: its body decoded, its policy, what reaches the engine."""

    body: ChatRequest | CompletionRequest
    policy: Policy
    session: str | None
    raw: bytes  # the body the engine gets
    headers: dict[str, str]  # the request headers the engine gets
    tokenize: bool  # small enough to tokenize (else routed without prefix knowledge)
    off_loop: bool  # long enough to tokenize on the worker thread
    target: Target  # where it may go and what each attempt sends
    flow: str  # whom it is fair to (router/dispatch/flow_gate.py flow_of)
    objective: str | None  # the objective it names
    ticket: FlowTicket | None = None  # its place in flow control, once admitted there
    trace: Trace = NULL_TRACE  # its root span (router/tracing/)

    @property
    def model(self) -> str:
        return self.body.model

    @property
    def streamed(self) -> bool:
        return bool(self.body.stream)


@dataclass(slots=True)
class Picked:
    """Where a gateway sends a request: the attempt at the chosen instance, and the fallbacks, best first."""

    outcome: Outcome
    fallbacks: tuple[Instance, ...]


class RoutingService:
    def __init__(
        self,
        upstreams: Upstreams,
        table: Callable[[], RoutingTable],
        decider: Decider,
        attempts: Attempts,
        admission: Admission,
        observers: Observers,
        tokenization: TokenizationConfig,
        flow_gate: FlowGate,
        tracing: Tracing = NULL_TRACING,
        *,
        keyed_clients: bool = False,
    ) -> None:
        """table: the routing table in force (a reload or PUT /admin/traffic replaces it whole); tracing:
        what starts each request's trace, which both front doors call (router/tracing/); keyed_clients:
        client keys are configured, and a stored response is its creating key's alone."""
        self.upstreams, self.decider, self.observers = upstreams, decider, observers
        self.tracing = tracing
        self._table, self._attempts, self._admission = table, attempts, admission
        self._flow_gate = flow_gate
        self._tokenized_max, self._thread_above = (
            tokenization.max_tokenized_bytes,
            tokenization.thread_above_bytes,
        )
        self.responses = StoredResponses(ResponseIds(upstreams), ResponseHistory())
        self._keyed_clients = keyed_clients

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

    async def receive(
        self,
        raw: bytes,
        api: Api,
        headers: Mapping[str, str],
        stored: str | None = None,
        query: str = "",
        trace: Trace = NULL_TRACE,
    ) -> Received:
        """The body decoded (a 400 in the route's shape when it is not what the route takes), its model
        served (else a 404), its policy chosen by the force header or the traffic split. stored: the stored
        response the path names (a retrieval or cancellation), with the query string of a retrieval; trace:
        the request's root span. A large body is decoded on a worker thread: an agent's megabytes of tools
        take a tenth of a second to translate, which the event loop spends on everyone else."""
        with trace.step("parse"):
            if len(raw) > self._thread_above:
                received = await asyncio.to_thread(self._received, raw, api, headers, stored, query, trace)
            else:
                received = self._received(raw, api, headers, stored, query, trace)
        trace.parsed(received.model, received.policy.name, received.streamed)
        return received

    def _received(
        self, raw: bytes, api: Api, headers: Mapping[str, str], stored: str | None, query: str, trace: Trace
    ) -> Received:
        read = self._read(raw, api, stored, query, headers)
        body = read.body
        if not self.upstreams.serves(body.model):
            raise model_not_found(body.model)
        table = self._table()
        session = headers.get(table.traffic.session_header) or read.session
        policy = table.policy_for(headers.get(table.traffic.force_header), session)
        tokenize = read.tokenize and len(raw) <= self._tokenized_max
        if api.body in ("chat", "completion"):
            raw = without_full_kv_report(raw, body.vllm_xargs)
        off_loop = len(raw) > self._thread_above
        target = Target(api.name, read.pinned, read.pinned_by, read.body_for, read.watch, api.get)
        flow_control = self._flow_gate.config
        flow = flow_of(flow_control, headers, session)
        objective = objective_of(flow_control, headers)
        headers = forwarded_headers(headers)
        return Received(
            body, policy, session, raw, headers, tokenize, off_loop, target, flow, objective, trace=trace
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

    async def wait_turn(self, received: Received, prepared: Prepared) -> Prepared:
        """Flow control: wait while every instance that could serve it is saturated (a 429 past a limit),
        then what the index and the pool hold now. A request a stored response pins to one instance does
        not wait for the fleet."""
        if received.target.pinned is not None:
            return prepared
        request = prepared.request
        # Untokenized (too large, or no tokenizer): about 4 bytes a token.
        tokens = request.prompt_tokens or len(received.raw) // 4
        work = uncached_at_best(request) if request.chain else tokens
        received.ticket = ticket = await self._flow_gate.wait(
            received.model, received.flow, received.objective, work, tokens
        )
        if ticket is None or not ticket.granted:
            return prepared
        received.trace.queued(ticket.queued_s, ticket.objective)
        try:
            return await self.decider.refresh(prepared)
        finally:
            self._flow_gate.started(ticket)

    async def send(self, received: Received, prepared: Prepared, path: str) -> Outcome:
        """Sent to the best instance with room, retried elsewhere while the client has had nothing: the
        outcome whose first bytes came (router/dispatch/attempts.py). A request for a stored response whose
        instance is gone gets vLLM's answer for an id it does not hold."""
        target = received.target
        try:
            outcome = await self._attempts.send(
                prepared,
                received.policy,
                path,
                received.raw,
                received.headers,
                received.streamed,
                target,
                received.trace,
            )
            outcome.ticket = received.ticket
            return outcome
        except OpenAIError as error:
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
        candidates = self._attempts.candidates(prepared, policy, outside or frozenset(), target.pinned)
        if not candidates and target.pinned_by is not None:
            raise response_not_found(target.pinned_by)
        if not candidates:
            code = "no_healthy_instance" if outside is None else "no_instance_in_subset"
            self.observers.request_rejected(policy, code)
            message = f"No healthy instance serves `{received.model}` right now. Retry later."
            raise unavailable(message, code, RETRY_AFTER_S)
        decision, scores = self.decider.decide_scored(prepared, policy, candidates, received.trace)
        others: tuple[Instance, ...] = ()
        if fallbacks and len(candidates) > 1:
            order = best_first(scores)
            others = tuple(candidates[i] for i in order if candidates[i] is not decision.instance)[:fallbacks]
        if target.body_for is not None:  # the body names the chosen instance: no other may serve it
            others = ()
        outcome = Outcome.start(
            self.observers, decision, policy, received.model, received.streamed, None, api=target.api
        )
        outcome.watch = target.watch
        outcome.ticket = received.ticket
        return Picked(outcome, others)

    def moved(self, outcome: Outcome, prepared: Prepared, served: Instance, skipped: int) -> Outcome:
        """The gateway could not reach outcome's instance and served the request from served, a fallback
        after skipped others: the first attempt failed, and the one at served is the request's."""
        outcome.abandon(None, failed=True, admitted=False, withdraw=True)
        decision = self.decider.decide(prepared, outcome.policy, [served])
        moved = Outcome.start(
            self.observers,
            decision,
            outcome.policy,
            outcome.model,
            outcome.streamed,
            outcome.first_sent,
            attempts=outcome.attempts + 1 + skipped,
            api=outcome.api,
        )
        moved.ticket = outcome.ticket
        return moved
