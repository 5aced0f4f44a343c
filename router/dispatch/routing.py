"""The routing service: the one way a request is routed, whichever front door it came in by.

`kvroute serve` (router/http/) relays the answer itself; `kvroute epp` (router/epp/) tells a gateway where
to send the request and follows the answer it relays. They differ only in how bytes move. Both call, in order:

    admit()            an admission slot, or a 429 when the router is at capacity
    receive(...)       the body decoded, its model checked, its policy taken from the routing table in force
                       (an agent API's translation to a chat belongs here, before the prompt is read)
                       (a flow-control queue belongs after it: a request waits there, holding no instance)
    prepare(...)       its prompt tokenized, hashed and looked up in the index
    send(...)          serve: an instance chosen, the request sent, retried elsewhere up to its first bytes
    pick(...)          epp: an instance chosen, and the fallbacks, best first; the gateway sends it
    leave()            the slot is free again, when the request's Outcome has ended

What became of the request is told by its Outcome (router/dispatch/outcome.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from router.config import TokenizationConfig
from router.dispatch.admission import Admission, Overloaded
from router.dispatch.attempts import Attempts
from router.dispatch.decision import Decider, Prepared
from router.dispatch.outcome import Observers, Outcome
from router.dispatch.routing_headers import forwarded_headers
from router.dispatch.routing_table import RoutingTable
from router.errors import RETRY_AFTER_S, model_not_found, too_many_requests, unavailable
from router.prompt.openai_body import ChatRequest, CompletionRequest, decode_body, without_full_kv_report
from router.upstreams.instances import Instance, Upstreams
from scorers.policy import Policy

Kind = type[ChatRequest] | type[CompletionRequest]
# The routes routed by their prompt, and the body each takes: both front doors serve these, and the engine's
# path is the client's. A new API (an agent's) is one more entry, with its stage in receive().
ROUTED_PATHS: Mapping[str, Kind] = {
    "/v1/chat/completions": ChatRequest,
    "/v1/completions": CompletionRequest,
}


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
    ) -> None:
        """table: the routing table in force (a reload or PUT /admin/traffic replaces it whole)."""
        self.upstreams, self.decider, self.observers = upstreams, decider, observers
        self._table, self._attempts, self._admission = table, attempts, admission
        self._tokenized_max, self._thread_above = (
            tokenization.max_tokenized_bytes,
            tokenization.thread_above_bytes,
        )

    async def admit(self) -> None:
        """Take an admission slot (waiting for one within admission's bounds), or raise a 429."""
        try:
            await self._admission.enter()
        except Overloaded as exc:
            self.observers.metrics.rejected(str(exc)).inc()
            message = "The router is at capacity; retry later."
            raise too_many_requests(message, str(exc), RETRY_AFTER_S) from exc

    def leave(self) -> None:
        """A request that held a slot is over."""
        self._admission.leave()

    def receive(self, raw: bytes, kind: Kind, headers: Mapping[str, str]) -> Received:
        """The body decoded (a 400 in the route's shape when it is not what the route takes), its model
        served (else a 404), its policy chosen by the force header or the traffic split."""
        body: ChatRequest | CompletionRequest = (
            decode_body(raw, ChatRequest, self.upstreams.only_model())
            if kind is ChatRequest
            else decode_body(raw, CompletionRequest, self.upstreams.only_model())
        )
        if not self.upstreams.serves(body.model):
            raise model_not_found(body.model)
        table = self._table()
        session = headers.get(table.traffic.session_header) or body.user
        policy = table.policy_for(headers.get(table.traffic.force_header), session)
        tokenize = len(raw) <= self._tokenized_max
        raw = without_full_kv_report(raw, body.vllm_xargs)
        off_loop = len(raw) > self._thread_above
        return Received(body, policy, session, raw, forwarded_headers(headers), tokenize, off_loop)

    async def prepare(self, received: Received) -> Prepared:
        """The prompt's token ids, blocks and matches in the index."""
        return await self.decider.prepare(
            received.body, received.session, received.tokenize, received.off_loop
        )

    async def send(self, received: Received, prepared: Prepared, path: str) -> Outcome:
        """Sent to the best instance with room, retried elsewhere while the client has had nothing: the
        outcome whose first bytes came (router/dispatch/attempts.py)."""
        return await self._attempts.send(
            prepared, received.policy, path, received.raw, received.headers, received.streamed
        )

    def pick(
        self, received: Received, prepared: Prepared, outside: frozenset[str] | None, fallbacks: int
    ) -> Picked:
        """The best instance with room but those outside (the gateway's subset hint leaves them out; None:
        it gave none), its attempt started, and up to fallbacks others, best first."""
        policy = received.policy
        candidates = self._attempts.candidates(prepared, policy, outside or frozenset())
        if not candidates:
            code = "no_healthy_instance" if outside is None else "no_instance_in_subset"
            self.observers.request_rejected(policy, code)
            message = f"No healthy instance serves `{received.model}` right now. Retry later."
            raise unavailable(message, code, RETRY_AFTER_S)
        decision = self.decider.decide(prepared, policy, candidates)
        others: tuple[Instance, ...] = ()
        if fallbacks and len(candidates) > 1:
            order = policy.ranked(prepared.request, candidates)
            others = tuple(candidates[i] for i in order if candidates[i] is not decision.instance)[:fallbacks]
        outcome = Outcome.start(self.observers, decision, policy, received.model, received.streamed, None)
        return Picked(outcome, others)

    def moved(self, outcome: Outcome, prepared: Prepared, served: Instance, skipped: int) -> Outcome:
        """The gateway could not reach outcome's instance and served the request from served, a fallback
        after skipped others: the first attempt failed, and the one at served is the request's."""
        outcome.abandon(None, failed=True, admitted=False, withdraw=True)
        decision = self.decider.decide(prepared, outcome.policy, [served])
        return Outcome.start(
            self.observers,
            decision,
            outcome.policy,
            outcome.model,
            outcome.streamed,
            outcome.first_sent,
            attempts=outcome.attempts + 1 + skipped,
        )
