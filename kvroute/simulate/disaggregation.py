"""Routing a disaggregated fleet: where each leg of a request goes, and kvroute's own way of choosing.

A request on a prefill/decode fleet takes one of two paths (kvroute/simulate/run.py DisaggregatedRun):
- disaggregated: its prefill leg, a one-token request on a prefill instance, computes the prompt; then its
  decode leg, on a decode instance, fetches the KV it does not hold from there and answers the client;
- skipped: a decode instance computes the whole request itself, as an aggregated instance would (its
  prefill leg was not worth it), or, fallback, because no prefill instance took the prefill leg.

kvroute's choices are the proxy's (router/dispatch/place/attempts.py, prefill_leg.py): the decode instance by
Decider.decide among the decode instances, its prefill leg only when PrefillLeg.worth_it, the prefill instance
by Decider.decide with the policy's prefill_leg among the prefill instances, the decode leg's TTFT features by
Decider.decode_leg; each instance's TTFT model observes its own leg.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from kvroute.simulate.engine import SimRequest
from kvroute.simulate.policies import ConfiguredPolicy, SimPolicy
from router.config import RouterConfig
from router.dispatch.decide.decision import Decision, Prepared
from router.dispatch.place.prefill_leg import prefill_leg_worth_it
from router.dispatch.place.retry_budget import RetryBudget
from router.upstreams.instances import Instance
from scorers.ttft_model import TTFTFeatures

# What a router does when a prefill instance refuses the prefill leg (its queue is full): try another one
# (the policy set request.prefill to it), let the decode instance compute the prompt, pass the 503 on to the
# client, or fail the request (HTTP 500).
Refusal = Literal["retry", "local", "reject", "fail"]


def prefill_leg(request: SimRequest, instance: int = -1) -> SimRequest:
    """request's prefill leg: its prompt, one output token, its KV kept for the decode leg."""
    return SimRequest(
        request.number,
        replace(request.trace, output_tokens=1),
        request.chain,
        request.session,
        instance=instance,
        prefills=request,
        text_chain=request.text_chain,
    )


class PDPolicy(SimPolicy):
    """A router of a disaggregated fleet. Its hooks (first_token, finished, refused) see each leg: a prefill
    leg's `prefills` is the request it is of."""

    def plan(self, request: SimRequest) -> int | None:
        """The decode instance, chosen now (counted in flight from now), or None: chosen once the prefill leg
        answered (decode_for). Sets request.prefill to the prefill leg (its instance chosen), or leaves it
        None: the decode instance computes the whole request."""
        raise NotImplementedError

    def decode_for(self, request: SimRequest) -> int:
        """The decode instance, for a plan that left it open."""
        raise NotImplementedError

    def prefill_refused(self, request: SimRequest) -> Refusal:
        raise NotImplementedError


def role_candidates(instances: list[Instance], leg: Literal["prefill", "decode"]) -> list[Instance]:
    """The instances that take leg (a decode instance also takes whole requests)."""
    other = "decode" if leg == "prefill" else "prefill"
    return [i for i in instances if i.role != other]


@dataclass(eq=False, slots=True)
class _Plan:
    prepared: Prepared
    whole: Decision  # the decode instance's, for the whole request
    prefill: Decision | None = None  # the prefill leg's under way
    tried: set[str] = field(default_factory=set)  # prefill instances tried


class KvroutePD(ConfiguredPolicy, PDPolicy):
    """kvroute in front of a disaggregated fleet, its choices made by the proxy's own code (module doc).

    A prefill instance that refuses the prefill leg is replaced by another, within upstream.attempts and the
    retry budget; then the decode instance computes the prompt (PrefillLeg.run's NoPrefill fallback)."""

    def __init__(self, name: str, config: RouterConfig, policy: str, **options: Any) -> None:
        super().__init__(name, config, policy, **options)
        self._local_max = config.disaggregation.local_prefill_max_tokens
        self._attempts = config.upstream.attempts
        self._budget = RetryBudget()
        self._plans: dict[int, _Plan] = {}

    def worth_it(self, decision: Decision) -> bool:
        return prefill_leg_worth_it(decision, self._local_max)

    def plan(self, request: SimRequest) -> int:
        view = self.view
        self._budget.earn()
        prepared = Prepared(self.routing(request))
        decodes = self.candidates(role_candidates(view.instances, "decode"))
        whole = self._router.decide(prepared, self._policy, decodes)
        plan = self._plans[request.number] = _Plan(prepared, whole)
        self._serve_whole(request, plan)
        if self.worth_it(whole):
            self._next_prefill(request, plan)
        return view.by_name[whole.instance.name]

    def _serve_whole(self, request: SimRequest, plan: _Plan) -> None:
        request.prefill = None
        request.uncached_estimate = plan.whole.uncached_tokens
        request.policy_state = plan.whole.features

    def _next_prefill(self, request: SimRequest, plan: _Plan) -> bool:
        """Choose a prefill instance not tried yet, as PrefillLeg.run does; False when none is left."""
        view, tried = self.view, plan.tried
        excluded = tried | {plan.whole.instance.name}
        prefills = [
            i
            for i in role_candidates(view.instances, "prefill")
            if i.name not in excluded and i.own_in_flight < self._limit
        ]
        if len(tried) >= self._attempts or not prefills or (tried and not self._budget.spend()):
            return False
        decision = self._router.decide(plan.prepared, self._policy.prefill_leg, prefills)
        plan.prefill = decision
        tried.add(decision.instance.name)
        leg = request.prefill = prefill_leg(request, view.by_name[decision.instance.name])
        leg.uncached_estimate = decision.uncached_tokens
        leg.policy_state = decision.features._replace(decoded_tokens=1)  # a whole answer of one token
        if decision.uncached_tokens:  # Outcome.start: a whole answer's prefill retires when predicted
            leg.retire_after_s = decision.predicted_ttft_s
        fetched = self._router.decode_leg(plan.whole)
        request.uncached_estimate, request.policy_state = fetched.uncached_tokens, fetched.features
        return True

    def prefill_refused(self, request: SimRequest) -> Refusal:
        plan = self._plans[request.number]
        if self._next_prefill(request, plan):
            return "retry"
        self._serve_whole(request, plan)
        return "local"

    def first_token(self, request: SimRequest) -> None:
        """Each instance's TTFT model learns from its leg: a prefill leg's whole answer from its sending, a
        decode leg's first token from the prefill leg's answer (Outcome.transferred), a whole request's from
        its sending."""
        features = request.policy_state
        if not self._calibrate or not isinstance(features, TTFTFeatures):
            return
        started = request.prefill.finish_s if request.prefill is not None else request.dispatched_s
        self.view.instances[request.instance].ttft_model.observe(features, request.first_token_s - started)

    def finished(self, request: SimRequest) -> None:
        if request.prefills is None:
            del self._plans[request.number]

    def refused(self, request: SimRequest) -> None:
        """The engine refused a leg: the blocks decide() entered for it there are taken back."""
        plan = self._plans[(request.prefills or request).number]
        if request.prefills is not None:
            assert plan.prefill is not None
            self._router.withdraw(plan.prefill)
        else:
            self._router.withdraw(plan.whole)
            del self._plans[request.number]
