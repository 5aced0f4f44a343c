"""Other routers' prefill/decode disaggregation with their published defaults (docs/bench-simulate.md,
"Prefill/decode disaggregation"), built from their aggregated algorithms in peers.py and registry.py.
"""

from __future__ import annotations

from typing import Literal

from kvroute.simulate.disaggregation import PDPolicy, Refusal, prefill_leg, role_candidates
from kvroute.simulate.engine import SimRequest
from kvroute.simulate.peers import CacheAwareTrees, DynamoCost
from kvroute.simulate.policies import ConfiguredPolicy
from kvroute.simulate.view import RouterView
from scorers.request import NO_MATCH
from scorers.ttft_features import features_for


def _numbers(view: RouterView, leg: Literal["prefill", "decode"]) -> list[int]:
    return [view.by_name[i.name] for i in role_candidates(view.instances, leg)]


class VllmRouterPD(PDPolicy):
    """vllm-router's P/D mode: the prefill and the decode worker each chosen up front by its own policy,
    --prefill-policy and --decode-policy, which default to --policy, cache_aware (SGLang's, CacheAwareTrees);
    the prefill leg, then the decode leg (NixlConnector, its default connector). Always two legs: its
    documented skip threshold (--pd-uncached-token-threshold) is not wired in its code. A failed prefill leg
    fails the request (HTTP 500), with no retry. Its load per worker counts a prefill leg until its answer and
    a decode leg until its stream starts (the simulation: its first token)."""

    name = "vllm-router"

    def bind(self, view: RouterView) -> None:
        super().bind(view)
        self._prefills, self._decodes = _numbers(view, "prefill"), _numbers(view, "decode")
        self._prefill_trees = CacheAwareTrees(self._prefills, view.block_size)
        self._decode_trees = CacheAwareTrees(self._decodes, view.block_size, seed=1)
        self._load = [0] * len(view.instances)
        self._decode_of: dict[int, int] = {}

    def plan(self, request: SimRequest) -> None:
        now, load = self.view.loop.now, self._load
        prefill = self._prefill_trees.choose(request, [load[n] for n in self._prefills], now)
        decode = self._decode_trees.choose(request, [load[n] for n in self._decodes], now)
        self._decode_of[request.number] = decode
        request.prefill = prefill_leg(request, prefill)
        load[prefill] += 1
        return None

    def decode_for(self, request: SimRequest) -> int:
        decode = self._decode_of.pop(request.number)
        self._load[decode] += 1
        return decode

    def prefill_refused(self, request: SimRequest) -> Refusal:
        del self._decode_of[request.number]
        return "fail"

    def first_token(self, request: SimRequest) -> None:
        self._load[request.instance] -= 1

    def refused(self, request: SimRequest) -> None:
        self._load[request.instance] -= 1


class LlmdPD(ConfiguredPolicy, PDPolicy):
    """llm-d's P/D (deploy/config/pd-epp-config.yaml): the decode profile first, prefix-cache-scorer 2 and
    queue-scorer 1, max score, among decode pods; prefix-based-pd-decider: a prefill leg when the prompt has
    at least nonCachedTokens (16) tokens the decode pod does not hold; then the prefill profile, the same
    scorers among prefill pods. Its sidecar (nixlv2, its default connector) runs the prefill leg, then the
    decode leg; a refused prefill leg's 503 goes to the client (--prefill-max-retries 0). The prefix scorer
    reads the KV-event index (GPU blocks, no pool tier), as the aggregated llm-d here; the sample config's
    approximate producer knows only the router's own history (and at most 16,384 prompt tokens)."""

    non_cached_tokens = 16

    def plan(self, request: SimRequest) -> int:
        view = self.view
        routing = self.routing(request)
        decodes = self.candidates(role_candidates(view.instances, "decode"))
        decode = decodes[self._policy.choose(routing, decodes)]
        request.uncached_estimate = features_for(routing, decode).uncached_tokens
        match = routing.matches.get(decode.name, NO_MATCH)
        tokens = request.trace.input_tokens
        if tokens - (match.gpu + match.cpu) * view.block_size >= self.non_cached_tokens:
            prefills = self.candidates(role_candidates(view.instances, "prefill"))
            prefill = prefills[self._policy.choose(routing, prefills)]
            leg = request.prefill = prefill_leg(request, view.by_name[prefill.name])
            leg.uncached_estimate = features_for(routing, prefill).uncached_tokens
            request.uncached_estimate = 0
        return view.by_name[decode.name]

    def prefill_refused(self, request: SimRequest) -> Refusal:
        return "reject"


class DynamoPD(PDPolicy):
    """Dynamo's PrefillRouter: the prefill worker first, by its KV router's cost (DynamoCost: overlap weight
    1, temperature 0) among prefill workers; once the prefill leg answered, the decode worker by the same
    router with overlap_score_weight 0 and assume_kv_reuse off (load only). Every request takes both legs
    while prefill workers are registered; a failed prefill leg falls back to the decode worker alone."""

    name = "dynamo"

    def bind(self, view: RouterView) -> None:
        super().bind(view)
        self._prefill = DynamoCost(workers=_numbers(view, "prefill"))
        self._decode = DynamoCost(
            seed=1, overlap_weight=0.0, assume_kv_reuse=False, workers=_numbers(view, "decode")
        )
        self._prefill.bind(view)
        self._decode.bind(view)

    def plan(self, request: SimRequest) -> None:
        leg = request.prefill = prefill_leg(request)
        leg.instance = self._prefill.route(leg)
        return None

    def decode_for(self, request: SimRequest) -> int:
        return self._decode.route(request)

    def prefill_refused(self, request: SimRequest) -> Refusal:
        return "local"

    def _router(self, request: SimRequest) -> DynamoCost:
        return self._prefill if request.prefills is not None else self._decode

    def first_token(self, request: SimRequest) -> None:
        self._router(request).first_token(request)

    def finished(self, request: SimRequest) -> None:
        self._router(request).finished(request)

    def refused(self, request: SimRequest) -> None:
        self._router(request).refused(request)
