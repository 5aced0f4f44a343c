"""What a request would cost on a candidate, as the TTFT model's features: computed in
scorers/_ttft_kernel.pyx, for one candidate here and for a whole fleet by the TTFT cost scorer."""

from __future__ import annotations

from collections.abc import Sequence

from scorers import _ttft_kernel
from scorers.candidate import Candidate
from scorers.request import NO_MATCH, RoutingRequest, TierMatch
from scorers.ttft_model import TTFTFeatures


def reused_blocks(request: RoutingRequest, name: str) -> TierMatch:
    """The blocks instance name would reuse, by tier (its GPU copy first, then CPU, then the pool): whole
    blocks only, and never the last prompt token's, which the engine computes whatever it holds."""
    match = request.matches.get(name, NO_MATCH)
    if match is NO_MATCH:  # most of a large fleet's instances: nothing to cap
        return NO_MATCH
    capped = _ttft_kernel.reused(match, request.prompt_tokens, request.block_size)
    return match if capped == (match.gpu, match.cpu, match.pool) else TierMatch(*capped)


def memory_wait_s(candidate: Candidate, prompt_tokens: int, chain: Sequence[int] = ()) -> float:
    """How long a prompt would wait there for KV memory; 0 while its capacity or hold time is unknown.
    Held tokens are the contexts in flight (the router's and its peers'), or the engine's reported usage
    when that is more (other clients); the prompt's blocks that this router's contexts in flight hold already
    take no more; at most every context in flight has to leave."""
    return _ttft_kernel.memory_wait_s(candidate, prompt_tokens, chain)


def features_for(request: RoutingRequest, candidate: Candidate) -> TTFTFeatures:
    """What the request would cost there."""
    return TTFTFeatures(*_ttft_kernel.features(request, candidate))
