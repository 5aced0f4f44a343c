"""The candidates the scorer tests use: every field a scorer reads, all defaulting to an idle instance; as
attributes of a Python object, or in C fields as the router keeps them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from scorers._candidate_state import CandidateState
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
    program_tokens: int = 0
    programs_alive: int = 0

    def shared_tokens(self, chain: Sequence[int]) -> int:
        return self.shared


class Kept(CandidateState):
    """A Fake's figures in C fields, as the router's instances keep theirs (scorers/_candidate_state.pyx)."""

    __slots__ = ("shared",)

    def __init__(self, fake: Fake) -> None:
        super().__init__(fake.name)
        self.in_flight, self.pending_prefill_tokens = fake.in_flight, fake.pending_prefill_tokens
        self.active_tokens, self.load = fake.active_tokens, fake.load
        self.kv_capacity_tokens, self.context_hold_s = fake.kv_capacity_tokens, fake.context_hold_s
        self.ttft_model, self.shared = fake.ttft_model, fake.shared

    def shared_tokens(self, chain: Sequence[int]) -> int:
        return self.shared
