"""The headers an answer carries about its routing, whichever front door relayed it, and the request
headers that reach the engine."""

from __future__ import annotations

from collections.abc import Mapping

from router.dispatch.observe.outcome import Outcome
from scorers.plugins import WAIT_CAUSED_S

POLICY_HEADER = "x-kvroute-policy"
SESSION_HEADER = "x-session-id"  # traffic.session_header's default, for clients
INSTANCE_HEADER = "x-kvroute-instance"  # the decode instance of a disaggregated request
PREFILL_INSTANCE_HEADER = "x-kvroute-prefill-instance"  # where its prompt's KV was computed
CACHED_BLOCKS_HEADER = "x-kvroute-cached-blocks"
PROMPT_BLOCKS_HEADER = "x-kvroute-prompt-blocks"
PREDICTED_TTFT_HEADER = "x-kvroute-predicted-ttft-ms"
WAIT_CAUSED_HEADER = "x-kvroute-wait-caused-ms"  # what the policy charged it for the wait of those behind
ATTEMPTS_HEADER = "x-kvroute-attempts"  # instances tried: more than 1 after a retry
QUEUED_HEADER = "x-kvroute-queued-ms"  # how long it waited in the router's queue (flow control)
# End-to-end headers that identify a request or carry its trace (vLLM reads traceparent and tracestate).
_FORWARDED_HEADERS = ("content-type", "accept", "x-request-id", "traceparent", "tracestate")


def forwarded_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """Only these reach the engine: the client's credentials and hop-by-hop headers never do."""
    return {k: v for k in _FORWARDED_HEADERS if (v := headers.get(k)) is not None}


def routing_headers(outcome: Outcome) -> dict[str, str]:
    """What the answer tells of its routing: the instance (and a disaggregated request's prefill instance),
    the policy, the prefix it was predicted to reuse, the TTFT and the wait it was charged for causing, the
    instances tried, the time it waited in the router's queue."""
    decision = outcome.decision
    headers = {
        INSTANCE_HEADER: outcome.instance.name,
        POLICY_HEADER: outcome.policy.name,
        CACHED_BLOCKS_HEADER: str(decision.cached_blocks),
        PROMPT_BLOCKS_HEADER: str(decision.prompt_blocks),
        PREDICTED_TTFT_HEADER: f"{decision.predicted_ttft_s * 1000:.1f}",
        WAIT_CAUSED_HEADER: f"{decision.explained.get(WAIT_CAUSED_S, 0.0) * 1000:.1f}",
        ATTEMPTS_HEADER: str(outcome.attempts),
    }
    if outcome.prefill_instance is not None:
        headers[PREFILL_INSTANCE_HEADER] = outcome.prefill_instance
    if outcome.ticket is not None:
        headers[QUEUED_HEADER] = f"{outcome.ticket.queued_s * 1000:.1f}"
    return headers
