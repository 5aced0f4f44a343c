"""The routing decision's data, shared by the index, the upstreams' view and the scorers: what a request
asks for, what each instance holds of it, and what an engine reports of its load."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class EngineLoad:
    waiting: float
    running: float
    kv_usage: float  # 0..1


@dataclass(frozen=True, slots=True)
class TierMatch:
    """Contiguous prompt blocks an instance holds from the start of the prompt, by tier."""

    gpu: int = 0
    cpu: int = 0
    pool: int = 0


NO_MATCH = TierMatch()


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    model: str
    session_key: str | None = None
    prompt_tokens: int = 0
    prompt_blocks: int = 0
    block_size: int = 16
    matches: Mapping[str, TierMatch] = field(default_factory=dict)  # by instance name; absent: no match
    chain: Sequence[int] = ()  # the hashes of the prompt's whole blocks (empty: unknown)
