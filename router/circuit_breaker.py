"""A per-instance circuit breaker fed by real requests: connection errors, timeouts and 5xx count, 4xx never.

Closed: requests flow and consecutive failures are counted. Open (after `failures` in a row): the instance
gets no requests for `open_s`. Half-open (after that): one request at a time is let through as a probe; its
success closes the breaker, its failure opens it again. Health checks cannot close it: an engine can answer
/health while every request fails.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class CircuitBreaker:
    failures: int = 5
    open_s: float = 10.0
    consecutive: int = 0
    opened_at: float | None = None
    probing: bool = False
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)

    def _now(self) -> float:
        return self.clock()

    @property
    def is_open(self) -> bool:
        return self.opened_at is not None and self._now() - self.opened_at < self.open_s

    def allows(self) -> bool:
        """Whether a request may be sent now (a half-open breaker lets one probe through at a time)."""
        if self.opened_at is None:
            return True
        return not self.is_open and not self.probing

    def sent(self) -> None:
        if self.opened_at is not None:
            self.probing = True

    def abandoned(self) -> None:
        """The request ended without telling anything about the instance (the client left, the router is
        shutting down): a probe's slot is free again."""
        self.probing = False

    def succeeded(self) -> None:
        self.consecutive, self.opened_at, self.probing = 0, None, False

    def failed(self) -> bool:
        """Count a failure; True when this one opened the breaker."""
        self.consecutive += 1
        self.probing = False
        if self.consecutive < self.failures:
            return False
        was_closed = self.opened_at is None
        self.opened_at = self._now()
        return was_closed
