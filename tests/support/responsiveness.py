"""How long a quick request waits while a server works on a large one: a thread probes it meanwhile."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


@dataclass
class Probed:
    took_s: float  # the large request's time
    waits_s: list[float] = field(default_factory=list)  # each probe's, while it ran

    @property
    def longest_s(self) -> float:
        return max(self.waits_s, default=0.0)


def probed_while(probe: Callable[[], object], work: Callable[[], T], gap_s: float = 0.02) -> tuple[T, Probed]:
    """work()'s result, and probe()'s times while it ran (probe called every gap_s, one at a time)."""
    done = threading.Event()
    probed = Probed(0.0)

    def poll() -> None:
        while not done.is_set():
            started = time.monotonic()
            probe()
            probed.waits_s.append(time.monotonic() - started)
            time.sleep(gap_s)

    poller = threading.Thread(target=poll)
    poller.start()
    started = time.monotonic()
    try:
        result = work()
    finally:
        probed.took_s = time.monotonic() - started
        done.set()
        poller.join(15)
    return result, probed
