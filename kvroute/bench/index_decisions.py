"""Decisions over fleets of several sizes for ``kvroute bench index``: an 80K-token agent turn's block chain
hashed, matched against the index and scored by the default policy over 8, 100 and 1,000 instances.

The fleet: every instance holds the session's shared system prompt (its first blocks), and ten of them hold
a tenth, two tenths... up to all of the session's history, as a fleet some of whose instances served the
session's earlier turns. Each instance also holds filler chains of its own, so the tables are of a fleet's
size, not of one session's. Each is busy as a scraped fleet is: its KV capacity, load and context hold time
known, an agent turn in flight, so that the scorers read all they read of a live instance. Choosing is also
measured over the same fleet nearly full (FULL_CAPACITY_TOKENS), the session's turn in flight on two of it.
Matching is measured twice: repeated at once, the tables' entries for the chain stay in the CPU's caches;
cold, EVICTING_BYTES are written first, as other traffic between a session's turns would.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable

import numpy as np

from kvroute.bench.index_parts import BLOCK_SIZE, durations, gpu_blocks
from router.index.block_index import BlockIndex
from router.prompt import block_hashing
from router.upstreams.instances import Instance
from scorers.candidate import EngineLoad
from scorers.policy import Policy
from scorers.policy_config import builtin_policies
from scorers.request import RoutingRequest, TierMatch

VOCAB = 150_000
SYSTEM_PROMPT_BLOCKS = 128  # 2,048 tokens every instance holds
SESSION_HOLDERS = 10
FILLER_BLOCKS = 2_000  # of each instance's own, besides the session's
MODEL = "m"
KV_CAPACITY_TOKENS = 500_000
IN_FLIGHT_TOKENS = 60_000
# A nearly full fleet: an 80K-token prompt overfills an instance with a 60K-token turn in flight, so choosing
# weighs what each holds of the prompt already (its memory wait). The session's own turn is in flight on two
# instances, other sessions' on the rest.
FULL_CAPACITY_TOKENS = 100_000
SESSION_IN_FLIGHT = 2
EVICTING_BYTES = 64 << 20  # well over a server CPU's last-level cache


def _fleet(instances: int, tokens: list[int], chain_blocks: int) -> BlockIndex:
    index = BlockIndex(BLOCK_SIZE, max_entries=instances * (chain_blocks + FILLER_BLOCKS) + 1)
    rng = random.Random(instances)
    filler = [rng.randrange(VOCAB) for _ in range(FILLER_BLOCKS * BLOCK_SIZE)]
    for n in range(instances):
        held = SYSTEM_PROMPT_BLOCKS
        if n < SESSION_HOLDERS:
            held = max(held, chain_blocks * (n + 1) // SESSION_HOLDERS)
        own = (n + 1) << 40  # every instance's vLLM hashes apart from the others'
        index.apply((f"i{n}", 0), [gpu_blocks(list(range(own, own + held)), tokens[: held * BLOCK_SIZE])])
        # A chain of its own, from a first token no other instance's starts with
        start = own + (1 << 32)
        index.apply((f"i{n}", 0), [gpu_blocks(list(range(start, start + FILLER_BLOCKS)), [n, *filler[1:]])])
    return index


def _busy(n: int, chain: list[int]) -> Instance:
    """Instance n of a live fleet: scraped (capacity, load), a context's hold time measured, a 60K-token turn
    of the session in flight."""
    instance = Instance(f"i{n}", f"http://127.0.0.1:{9000 + n}", frozenset({MODEL}))
    instance.kv_capacity_tokens = KV_CAPACITY_TOKENS
    instance.load = EngineLoad(waiting=1.0, running=4.0, kv_usage=0.2 + (n % 7) / 10)
    instance.start(IN_FLIGHT_TOKENS, 0)  # a turn answered: a hold time known
    instance.end(IN_FLIGHT_TOKENS)
    instance.start(IN_FLIGHT_TOKENS, 1_000, chain[: IN_FLIGHT_TOKENS // BLOCK_SIZE])
    return instance


def _nearly_full(size: int, chain: list[int]) -> list[Instance]:
    """The fleet's instances nearly full (FULL_CAPACITY_TOKENS), the session's turn in flight on
    SESSION_IN_FLIGHT of them and another session's on the rest."""
    rng = random.Random(size)
    other = block_hashing.chain([rng.randrange(VOCAB) for _ in range(IN_FLIGHT_TOKENS)], BLOCK_SIZE)
    candidates = [_busy(n, chain if n < SESSION_IN_FLIGHT else other) for n in range(size)]
    for instance in candidates:
        instance.kv_capacity_tokens = FULL_CAPACITY_TOKENS
    return candidates


def _choosing(
    candidates: list[Instance], tokens: list[int], chain: list[int], matches: dict[str, TierMatch]
) -> Callable[[], None]:
    """One choice of the default policy (a policy of its own) over candidates for the prompt."""
    policy = Policy("kvroute", builtin_policies()["kvroute"])

    def choose() -> None:
        request = RoutingRequest(MODEL, "session", len(tokens), len(chain), BLOCK_SIZE, matches, chain)
        policy.choose(request, candidates)

    return choose


def _median_ms(action: Callable[[], object], repeats: int) -> float:
    return statistics.median(durations(action, repeats)) * 1e3


def _cold_median_ms(action: Callable[[], object], repeats: int) -> float:
    """_median_ms of action, EVICTING_BYTES written before each call (not timed)."""
    evicting = np.zeros(EVICTING_BYTES // 8)
    samples = []
    for _ in range(repeats):
        evicting += 1.0
        samples.extend(durations(action, 1))
    return statistics.median(samples) * 1e3


def measure_decisions(
    fleet_sizes: tuple[int, ...] = (8, 100, 1_000), prompt_tokens: int = 80_000, repeats: int = 20
) -> dict[str, dict[str, float]]:
    """Per fleet size: hashing the prompt's chain, matching it, choosing with the default policy (ms)."""
    rng = random.Random(prompt_tokens)
    tokens = [rng.randrange(VOCAB) for _ in range(prompt_tokens)]
    return {str(size): _measure_fleet(size, tokens, repeats) for size in fleet_sizes}


def _measure_fleet(size: int, tokens: list[int], repeats: int) -> dict[str, float]:
    chain = block_hashing.chain(tokens, BLOCK_SIZE)
    index = _fleet(size, tokens, len(chain))
    matches = index.match(chain)
    busy = [_busy(n, chain) for n in range(size)]
    hash_ms = _median_ms(lambda: block_hashing.chain(tokens, BLOCK_SIZE), repeats)
    match_ms = _median_ms(lambda: index.match(chain), repeats)
    cold_match_ms = _cold_median_ms(lambda: index.match(chain), repeats)
    choose_ms = _median_ms(_choosing(busy, tokens, chain, matches), repeats)
    full_choose_ms = _median_ms(_choosing(_nearly_full(size, chain), tokens, chain, matches), repeats)
    return {
        "hash_ms": hash_ms,
        "match_ms": match_ms,
        "cold_match_ms": cold_match_ms,
        "choose_ms": choose_ms,
        "full_choose_ms": full_choose_ms,
        "decision_ms": hash_ms + match_ms + choose_ms,
        "matched_instances": len(matches),
        "index_entries": index.entries,
    }
