"""How a YAML `type` becomes a plugin (a scorer, a picker): its parameters decoded strictly, then its
factory."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict

T = TypeVar("T")


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
        self,
        raw_params: dict[str, Any],
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> T:
        params = self.params.model_validate(raw_params)
        extra: list[Any] = [clock] if self.clocked else []
        if self.randomized:
            extra.append(rng)
        return self.factory(params, *extra)
