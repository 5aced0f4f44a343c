"""Routing a disaggregated fleet: where each leg of a request goes, by the peers' routers.

A request on a prefill/decode fleet takes one of two paths (kvroute/simulate/run.py DisaggregatedRun):
- disaggregated: its prefill leg, a one-token request on a prefill instance, computes the prompt; then its
  decode leg, on a decode instance, fetches the KV it does not hold from there and answers the client;
- skipped: a decode instance computes the whole request itself, as an aggregated instance would (its
  prefill leg was not worth it), or, fallback, because no prefill instance took the prefill leg.

kvroute itself runs through the product's conductor (kvroute/simulate/conducted.py), its legs sent as the
proxy sends them (router/dispatch/place/attempts.py, prefill_leg.py); the peers' routers are PDPolicy's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from kvroute.simulate.engine import SimRequest
from kvroute.simulate.policies import SimPolicy
from router.upstreams.instances import Instance

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
