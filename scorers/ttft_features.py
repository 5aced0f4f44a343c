"""What a request would cost on a candidate, as the TTFT model's features."""

from __future__ import annotations

from collections.abc import Sequence

from scorers.candidate import Candidate
from scorers.request import NO_MATCH, RoutingRequest, TierMatch
from scorers.ttft_model import TTFTFeatures, attention_pairs


def reused_blocks(request: RoutingRequest, name: str) -> TierMatch:
    """The blocks instance name would reuse, by tier (its GPU copy first, then CPU, then the pool): whole
    blocks only, and never the last prompt token's, which the engine computes whatever it holds."""
    match = request.matches.get(name, NO_MATCH)
    if match is NO_MATCH:  # most of a large fleet's instances: nothing to cap
        return NO_MATCH
    reusable = max(request.prompt_tokens - 1, 0) // request.block_size
    if match.gpu + match.cpu + match.pool <= reusable:  # within the cap: the match itself, no new one
        return match
    gpu = min(match.gpu, reusable)
    cpu = min(match.cpu, reusable - gpu)
    return TierMatch(gpu, cpu, min(match.pool, reusable - gpu - cpu))


def memory_wait_s(candidate: Candidate, prompt_tokens: int, chain: Sequence[int] = ()) -> float:
    """How long a prompt would wait there for KV memory; 0 while its capacity or hold time is unknown.
    Held tokens are the contexts in flight (the router's and its peers'), or the engine's reported usage
    when that is more (other clients); the prompt's blocks that this router's contexts in flight hold already
    take no more; at most every context in flight has to leave."""
    capacity, hold_s = candidate.kv_capacity_tokens, candidate.context_hold_s
    if not capacity or hold_s is None:
        return 0.0
    held = float(candidate.active_tokens)
    if candidate.load is not None:
        held = max(held, candidate.load.kv_usage * capacity)
    excess = held + prompt_tokens - capacity
    if excess > 0:  # only then can what requests in flight share of the prompt matter
        excess -= candidate.shared_tokens(chain)
    if excess <= 0 or held <= 0:
        return 0.0
    return hold_s * min(excess / held, 1.0)


def features_for(request: RoutingRequest, candidate: Candidate) -> TTFTFeatures:
    """What the request would cost there."""
    reused = reused_blocks(request, candidate.name)
    loaded = reused.cpu + reused.pool
    kept = (reused.gpu + loaded) * request.block_size
    uncached = request.prompt_tokens - kept
    return TTFTFeatures(
        queued_tokens=candidate.pending_prefill_tokens,
        uncached_tokens=uncached,
        loaded_tokens=loaded * request.block_size,
        memory_wait_s=memory_wait_s(candidate, request.prompt_tokens, request.chain),
        attention_pairs=attention_pairs(kept, uncached),
    )


def wait_caused_s(
    candidate: Candidate, features: TTFTFeatures, predicted_s: float, behind_per_s: float
) -> float:
    """The wait a request placed there causes the requests arriving behind it: behind_per_s x its predicted
    TTFT of them, each queued behind its uncached tokens (the queue term's rate)."""
    return behind_per_s * predicted_s * candidate.ttft_model.queue_rate * features.uncached_tokens
