"""What every scorer sees and promises: candidates in, one score in [0, 1] per candidate out."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict

T = TypeVar("T")


class Candidate(Protocol):
    """The view of an instance that scorers read."""

    @property
    def name(self) -> str: ...

    @property
    def in_flight(self) -> int: ...


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    model: str
    session_key: str | None = None


class Scorer(Protocol):
    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        """One score per candidate, in [0, 1], higher is better."""
        ...


class Params(BaseModel):
    """A plugin's parameters: strict, unknown keys are errors, defaults filled in."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class Registration(Generic[T]):
    """How the YAML `type` of a plugin becomes an object: its parameters model and its factory."""

    params: type[Params]
    factory: Callable[[Any], T]

    def build(self, raw_params: dict[str, Any]) -> T:
        return self.factory(self.params.model_validate(raw_params))
