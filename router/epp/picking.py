"""Pick: the endpoints a gateway sends one request to, decided as `kvroute serve` decides, by the same
routing service (router/dispatch/conductor.py).

The gateway proxies the request itself: the attempt is an Outcome started here and ended by the response's
events (router/epp/session.py). The other candidates, best score first, are the fallbacks the gateway tries
when the chosen one cannot be reached.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from router.apis.routes import routed_api
from router.dispatch.conductor import Conductor, Picked
from router.dispatch.context import Arrival, FlowTicket, Received
from router.dispatch.decide.decision import Prepared
from router.dispatch.observe.outcome import Outcome
from router.epp.messages import endpoint
from router.errors import RETRY_AFTER_S, unavailable
from router.metrics import RouterMetrics
from router.upstreams.health import HealthChecker
from router.upstreams.instances import Instance


@dataclass(eq=False)
class Routed:
    """Where one request goes: endpoints in the order the gateway tries them, and the body it sends."""

    endpoints: list[str]
    body: bytes
    outcome: Outcome | None = None  # the attempt at endpoints[0]; None: not an inference request
    prepared: Prepared | None = None
    fallbacks: tuple[Instance, ...] = ()


class Picker:
    def __init__(
        self, routing: Conductor, health: HealthChecker, metrics: RouterMetrics, fallbacks: int
    ) -> None:
        """routing: a started runtime's; fallbacks: how many endpoints after the chosen one the gateway may
        try (0 for a gateway that reads one only, as ORIGINAL_DST does)."""
        self.routing, self.metrics = routing, metrics
        self._health, self._fallbacks = health, fallbacks

    async def route(
        self, method: str, path: str, headers: Mapping[str, str], raw: bytes, subset: frozenset[str] | None
    ) -> Routed:
        """Where the request goes, or an OpenAIError for the gateway to answer (429, 503, 4xx). An inference
        request's Routed holds an admission slot until its outcome ends (leave)."""
        path, _, query = path.partition("?")
        found = routed_api(method, path)
        if found is None:
            return self._anywhere(subset, raw)
        api, stored = found
        routing = self.routing
        # A span for the decision alone: the gateway sends the request, and the engine's spans are its.
        trace = routing.trace(f"pick {method}", path, stored, headers)

        async def pick(received: Received, prepared: Prepared) -> Routed:
            outside = None if subset is None else self._outside(received.model, subset)
            return self._routed(
                received, prepared, routing.pick(received, prepared, outside, self._fallbacks)
            )

        try:
            routed = await routing.conduct(Arrival(raw, api, headers, stored, query, trace), pick)
        except BaseException as error:
            trace.failed(error)
            trace.end()
            raise
        trace.set("kvroute.fallbacks", len(routed.fallbacks))
        trace.end()
        return routed

    @staticmethod
    def _routed(received: Received, prepared: Prepared, picked: Picked) -> Routed:
        """The endpoints in the order the gateway tries them, and the body it sends the chosen one."""
        chosen = picked.outcome.instance
        endpoints = [endpoint(i.url) for i in (chosen, *picked.fallbacks)]
        body_for = received.target.body_for
        body = received.raw if body_for is None else body_for(chosen)
        return Routed(endpoints, body, picked.outcome, prepared, picked.fallbacks)

    def leave(self, ticket: FlowTicket | None) -> None:
        """A routed inference request is over: its admission slot is free, and its place in flow control."""
        self.routing.leave(ticket)

    def moved(self, routed: Routed, outcome: Outcome, served: Instance) -> Outcome:
        """The gateway could not reach outcome's instance and served the request from served, a fallback:
        the first attempt failed (its breaker and health learn it) and the one at served is the request's."""
        failed = outcome.instance
        assert routed.prepared is not None
        moved = self.routing.moved(outcome, routed.prepared, served, routed.fallbacks.index(served))
        self._health.mark_unreachable(failed)
        self.metrics.upstream_errors(failed.name, "connect").inc()
        self.metrics.retries(failed.name).inc()
        return moved

    def _outside(self, model: str, subset: frozenset[str]) -> frozenset[str]:
        """The names of model's instances the gateway's subset hint leaves out."""
        instances = self.routing.upstreams.candidates(model)
        return frozenset(i.name for i in instances if endpoint(i.url) not in subset)

    def _anywhere(self, subset: frozenset[str] | None, raw: bytes) -> Routed:
        """A request that is not a completion (GET /v1/models, /health...): the least busy healthy instance,
        nothing accounted."""
        healthy = [
            i
            for i in self.routing.upstreams.instances
            if i.healthy and (subset is None or endpoint(i.url) in subset)
        ]
        if not healthy:
            message = "No healthy instance right now. Retry later."
            raise unavailable(message, "no_healthy_instance", RETRY_AFTER_S)
        return Routed([endpoint(min(healthy, key=lambda i: i.in_flight).url)], raw)
