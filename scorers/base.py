"""What every scorer sees and promises: candidates in, one score in [0, 1] per candidate out."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from scorers.ttft_model import TTFTModel

T = TypeVar("T")


class Candidate(Protocol):
    """The view of an instance that scorers read."""

    @property
    def name(self) -> str: ...

    @property
    def in_flight(self) -> int:
        """Requests in flight there: those this router sent and has not seen finish, and its peer routers'
        (router/peer_load.py)."""
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
    def ttft_model(self) -> TTFTModel:
        """Its time-to-first-token model, calibrated from what the router observes."""
        ...


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


class Scorer(Protocol):
    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        """One score per candidate, in [0, 1], higher is better."""
        ...


def lower_is_better(values: Sequence[float | None]) -> list[float]:
    """llm-d's normalization: (max - v) / (max - min) over the known values; equal ones all score 1;
    an unknown value (None) scores 0."""
    known = [v for v in values if v is not None]
    if not known:
        return [0.0] * len(values)
    low, high = min(known), max(known)
    span = high - low
    return [0.0 if v is None else 1.0 if span == 0 else (high - v) / span for v in values]


@runtime_checkable
class Observer(Protocol):
    """A scorer that learns from decisions (session affinity): told the chosen instance after each pick."""

    def observe(self, request: RoutingRequest, chosen: Candidate) -> None: ...


class Params(BaseModel):
    """A plugin's parameters: strict, unknown keys are errors, defaults filled in."""

    # As the configuration's: an .inf rate or weight is a typo, and inf * 0 = nan breaks scoring.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


@dataclass(frozen=True)
class Registration(Generic[T]):
    """How the YAML `type` of a plugin becomes an object: its parameters model and its factory."""

    params: type[Params]
    factory: Callable[..., T]
    clocked: bool = False  # the factory takes a clock after the parameters (state that expires)
    randomized: bool = False  # the factory then takes a random.Random or None (pickers' ties)

    def build(
        self, raw_params: dict[str, Any], clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> T:  # fmt: skip
        params = self.params.model_validate(raw_params)
        extra: list[Any] = [clock] if self.clocked else []
        if self.randomized:
            extra.append(rng)
        return self.factory(params, *extra)
