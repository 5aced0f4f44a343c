"""What a scorer reads of a request: its prompt's blocks, and what each instance holds of them, by tier."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


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
    # It starts an agent program, or one whose working set lapsed or whose instance's working sets outgrew its
    # KV cache (router/programs)
    new_program: bool = False
    programs_come_back: bool = True  # most programs come back for another turn: their contexts grow
