"""The view of an instance that scorers and the TTFT model read."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from scorers.ttft_model import TTFTModel


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What an engine reports of its load (its /metrics)."""

    waiting: float
    running: float
    kv_usage: float  # 0..1


class Candidate(Protocol):
    """The view of an instance that scorers read."""

    @property
    def name(self) -> str: ...

    @property
    def in_flight(self) -> int:
        """Requests in flight there: those this router sent and has not seen finish, and its peer routers'
        (router/upstreams/peer_load.py)."""
        ...

    @property
    def active_tokens(self) -> int:
        """KV tokens the requests in flight there hold (the contexts being decoded): this router's, a prefix
        they share counted once, as the engine's prefix cache holds it, and its peer routers'."""
        ...

    def shared_tokens(self, chain: Sequence[int]) -> int:
        """Tokens of the prompt's leading blocks (hashed to chain) that requests in flight there hold."""
        ...

    @property
    def pending_prefill_tokens(self) -> int:
        """Uncached prompt tokens of those requests (this router's and its peers') that have not produced a
        first byte yet: the prefill work queued ahead of a new request."""
        ...

    @property
    def kv_capacity_tokens(self) -> int | None:
        """Tokens its KV cache holds (the engine's vllm:cache_config_info); None until known."""
        ...

    @property
    def context_hold_s(self) -> float | None:
        """How long a context token stays there, dispatch to last token (measured); None until known."""
        ...

    @property
    def load(self) -> EngineLoad | None:
        """The engine's own view from its /metrics; None until scraped or once stale."""
        ...

    @property
    def program_tokens(self) -> int:
        """The KV working sets of the agent programs there: the prompts of those running and of those in a
        tool call (router/programs/); 0 when programs are not followed."""
        ...

    @property
    def programs_alive(self) -> int:
        """The agent programs whose working sets program_tokens counts; 0 when programs are not followed."""
        ...

    @property
    def ttft_model(self) -> TTFTModel:
        """Its time-to-first-token model, calibrated from what the router observes."""
        ...
