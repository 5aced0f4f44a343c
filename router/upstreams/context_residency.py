"""How long an instance keeps a request's context in its KV cache: the time from dispatch to the last token,
weighted by the context's tokens. By Little's law it is the tokens in flight over the tokens released per
second, which is how it is measured here: no per-request timestamps, and the few longest contexts, which
decide when memory frees up, weigh in by their size.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class ContextResidency:
    def __init__(self, clock: Callable[[], float] = time.monotonic, memory: float = 100.0) -> None:
        """memory: about how many of the latest finished requests the estimate follows."""
        self._clock = clock
        self._decay = 1.0 - 1.0 / memory
        self.tokens = 0  # context tokens in flight now
        self._since = clock()
        self._token_seconds = 0.0  # integral of tokens over time up to the last release, decayed
        self._recent = 0.0  # the integral since the last release
        self._released = 0.0  # tokens released, decayed alike
        # The mean time a context token stays; None until a request has finished. Kept, not computed when
        # read: the TTFT cost reads it of every candidate of every decision.
        self.seconds: float | None = None

    def _advance(self) -> None:
        now = self._clock()
        self._recent += self.tokens * (now - self._since)
        self._since = now

    def add(self, tokens: int) -> None:
        self._advance()
        self.tokens += tokens

    def release(self, tokens: int) -> None:
        self._advance()
        self.tokens -= tokens
        self._token_seconds = self._token_seconds * self._decay + self._recent
        self._released = self._released * self._decay + tokens
        self._recent = 0.0
        self.seconds = self._token_seconds / self._released if self._released > 0 else None

    def withdraw(self, tokens: int) -> None:
        """A request the engine refused or never got: it held no memory, so it does not count as a release
        (at a hold of ~0 s it would pull the estimate down whenever an instance sheds load)."""
        self._advance()
        self.tokens -= tokens
