"""A per-instance circuit breaker fed by real requests: connection errors, timeouts and 5xx count, 4xx never.

Closed: requests flow and consecutive failures are counted (a success starts the count again). Open (after
`failures` in a row): the instance gets no requests for `open_s`. Half-open (after that): one request at a
time is let through as a probe; only the probe decides: its success closes the breaker, its failure opens
it again, and answers to requests sent before it opened change nothing. A probe that has not finished
within another `open_s` no longer holds the slot. Health checks cannot close the breaker: an engine can
answer /health while every request fails.
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
    probe_sent_at: float | None = None
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)

    def allows(self) -> bool:
        """Whether a request may be sent now (a half-open breaker lets one probe through at a time)."""
        if self.opened_at is None:
            return True
        now = self.clock()
        if now - self.opened_at < self.open_s:
            return False
        return self.probe_sent_at is None or now - self.probe_sent_at >= self.open_s

    def sent(self) -> bool:
        """A request goes to the instance; True when it is the half-open breaker's probe."""
        if self.opened_at is None:
            return False
        self.probe_sent_at = self.clock()
        return True

    def abandoned(self, probe: bool) -> None:
        """The request ended without telling anything about the instance (a 4xx, the client left, the
        router is shutting down): a probe's slot is free again."""
        if probe:
            self.probe_sent_at = None

    def succeeded(self, probe: bool) -> None:
        if probe:
            self.opened_at = self.probe_sent_at = None
        if self.opened_at is None:
            self.consecutive = 0

    def failed(self, probe: bool) -> bool:
        """Count a failure; True when this one opened a closed breaker."""
        if probe:
            self.opened_at, self.probe_sent_at = self.clock(), None
            return False
        if self.opened_at is not None:
            return False  # sent before it opened: already counted in
        self.consecutive += 1
        if self.consecutive < self.failures:
            return False
        self.opened_at = self.clock()
        return True
