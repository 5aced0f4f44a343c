"""The candidate the scorer tests use: every field a scorer reads, all defaulting to an idle instance."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from scorers.candidate import EngineLoad
from scorers.ttft_model import TTFTModel, TTFTPriors


@dataclass
class Fake:
    name: str
    in_flight: int = 0
    pending_prefill_tokens: int = 0
    active_tokens: int = 0
    load: EngineLoad | None = None
    kv_capacity_tokens: int | None = None
    context_hold_s: float | None = None
    ttft_model: TTFTModel = field(default_factory=lambda: TTFTModel(TTFTPriors()))
    shared: int = 0  # tokens of any prompt's prefix held by requests in flight

    def shared_tokens(self, chain: Sequence[int]) -> int:
        return self.shared
