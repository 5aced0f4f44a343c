"""Pick: the endpoints a gateway sends one request to, decided as `kvroute serve` decides, by the same parts.

The body is decoded (router/prompt/), the policy taken from the routing table in force (the A/B split, the
force header), the prompt prepared (tokenized, hashed, looked up in the index) and an instance chosen among
the healthy ones with room (router/dispatch/attempts.py), holding an admission slot. The gateway then proxies
the request itself: the attempt is an Outcome started here and ended by the response's events
(router/epp/session.py). The other candidates, best score first, are the fallbacks the gateway tries when the
chosen one cannot be reached.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from router.dispatch.admission import Overloaded
from router.dispatch.attempts import RETRY_AFTER_S
from router.dispatch.decision import Prepared
from router.dispatch.outcome import Observers, Outcome
from router.epp.messages import endpoint
from router.errors import model_not_found, too_many_requests, unavailable
from router.prompt.openai_body import ChatRequest, CompletionRequest, decode_body, without_full_kv_report
from router.runtime import Runtime
from router.upstreams.instances import Instance
from scorers.policy import Policy

Kind = type[ChatRequest] | type[CompletionRequest]
ROUTED_PATHS: Mapping[str, Kind] = {
    "/v1/chat/completions": ChatRequest,
    "/v1/completions": CompletionRequest,
}


@dataclass(eq=False)
class Routed:
    """Where one request goes: endpoints in the order the gateway tries them, and the body it sends."""

    endpoints: list[str]
    body: bytes
    outcome: Outcome | None = None  # the attempt at endpoints[0]; None: not an inference request
    prepared: Prepared | None = None
    fallbacks: tuple[Instance, ...] = ()


class Picker:
    def __init__(self, runtime: Runtime, fallbacks: int) -> None:
        """runtime: started (its decider, attempts and admission exist); fallbacks: how many endpoints after
        the chosen one the gateway may try (0 for a gateway that reads one only, as ORIGINAL_DST does)."""
        self.runtime, self._fallbacks = runtime, fallbacks
        self.observers = Observers(
            runtime.metrics,
            runtime.decider,
            lambda policy: runtime.table.ab_for(policy),
            runtime.memory_freed,
        )

    async def route(
        self, method: str, path: str, headers: Mapping[str, str], raw: bytes, subset: frozenset[str] | None
    ) -> Routed:
        """Where the request goes, or an OpenAIError for the gateway to answer (429, 503, 4xx). An inference
        request's Routed holds an admission slot until its outcome ends (release)."""
        kind = ROUTED_PATHS.get(path.partition("?")[0])
        if kind is None or method != "POST":
            return self._anywhere(subset, raw)
        runtime = self.runtime
        try:
            await runtime.admission.enter()
        except Overloaded as exc:
            runtime.metrics.rejected(str(exc)).inc()
            message = "The router is at capacity; retry later."
            raise too_many_requests(message, str(exc), RETRY_AFTER_S) from exc
        try:
            return await self._route(headers, raw, kind, subset)
        except BaseException:
            runtime.admission.leave()
            raise

    def leave(self) -> None:
        """A routed inference request is over: its admission slot is free."""
        self.runtime.admission.leave()

    def moved(self, routed: Routed, outcome: Outcome, served: Instance) -> Outcome:
        """The gateway could not reach outcome's instance and served the request from served, a fallback:
        the first attempt failed (its breaker and health learn it) and the one at served is the request's."""
        runtime, failed = self.runtime, outcome.instance
        outcome.abandon(None, failed=True, admitted=False, withdraw=True)
        runtime.health.mark_unreachable(failed)
        runtime.metrics.upstream_errors(failed.name, "connect").inc()
        runtime.metrics.retries(failed.name).inc()
        assert routed.prepared is not None
        decision = runtime.decider.decide(routed.prepared, outcome.policy, [served])
        moved = Outcome.start(
            self.observers, decision, outcome.policy, outcome.model, outcome.streamed, outcome.first_sent
        )
        moved.attempts = outcome.attempts + 1 + routed.fallbacks.index(served)
        return moved

    async def _route(
        self, headers: Mapping[str, str], raw: bytes, kind: Kind, subset: frozenset[str] | None
    ) -> Routed:
        runtime = self.runtime
        upstreams = runtime.upstreams
        only = upstreams.only_model()
        body: ChatRequest | CompletionRequest = (
            decode_body(raw, ChatRequest, only)
            if kind is ChatRequest
            else decode_body(raw, CompletionRequest, only)
        )
        if not upstreams.serves(body.model):
            raise model_not_found(body.model)
        table = runtime.table
        session = headers.get(table.traffic.session_header) or body.user
        policy = table.policy_for(headers.get(table.traffic.force_header), session)
        limits = runtime.config.tokenization
        tokenize, off_loop = len(raw) <= limits.max_body_bytes, len(raw) > limits.thread_above_bytes
        prepared = await runtime.decider.prepare(body, session, tokenize, off_loop)
        outside = frozenset() if subset is None else self._outside(body.model, subset)
        candidates = runtime.attempts.candidates(body.model, policy, outside)
        if not candidates:
            table.ab_for(policy).rejected(policy.name)
            code = "no_healthy_instance" if subset is None else "no_instance_in_subset"
            runtime.metrics.rejected(code).inc()
            message = f"No healthy instance serves `{body.model}` right now. Retry later."
            raise unavailable(message, code, RETRY_AFTER_S)
        decision = runtime.decider.decide(prepared, policy, candidates)
        others = self._ranked(prepared, policy, candidates, decision.instance)
        outcome = Outcome.start(self.observers, decision, policy, body.model, bool(body.stream), None)
        return Routed(
            [endpoint(i.url) for i in (decision.instance, *others)],
            without_full_kv_report(raw, body.vllm_xargs),
            outcome,
            prepared,
            others,
        )

    def _ranked(
        self, prepared: Prepared, policy: Policy, candidates: list[Instance], chosen: Instance
    ) -> tuple[Instance, ...]:
        if not self._fallbacks or len(candidates) == 1:
            return ()
        order = policy.ranked(prepared.request, candidates)
        return tuple(candidates[i] for i in order if candidates[i] is not chosen)[: self._fallbacks]

    def _outside(self, model: str, subset: frozenset[str]) -> frozenset[str]:
        """The names of model's instances the gateway's subset hint leaves out."""
        instances = self.runtime.upstreams.candidates(model)
        return frozenset(i.name for i in instances if endpoint(i.url) not in subset)

    def _anywhere(self, subset: frozenset[str] | None, raw: bytes) -> Routed:
        """A request that is not a completion (GET /v1/models, /health...): the least busy healthy instance,
        nothing accounted."""
        healthy = [
            i
            for i in self.runtime.upstreams.instances
            if i.healthy and (subset is None or endpoint(i.url) in subset)
        ]
        if not healthy:
            message = "No healthy instance right now. Retry later."
            raise unavailable(message, "no_healthy_instance", RETRY_AFTER_S)
        return Routed([endpoint(min(healthy, key=lambda i: i.in_flight).url)], raw)
