"""How long an agent's tool calls last: the time-to-live a program's KV is worth keeping between turns."""

from __future__ import annotations

from collections import deque

from router.programs.settings import ProgramsConfig

WINDOW = 1024  # the tool calls the quantile is taken over: the latest, so that it follows the workload
_SOLVE_EVERY = 16  # calls observed between two sorts of the window


class ToolCalls:
    """The lengths of the latest tool calls (a turn's answer to the program's next turn), and the
    time-to-live learned from them: a quantile, clamped, or the prior until enough were seen."""

    def __init__(self, settings: ProgramsConfig) -> None:
        self._settings = settings
        self._lengths: deque[float] = deque(maxlen=WINDOW)
        self._since_solved = 0
        self.ttl_s = settings.ttl_prior_s
        self.observed = 0

    def observe(self, length_s: float) -> None:
        self._lengths.append(length_s)
        self.observed += 1
        self._since_solved += 1
        settings = self._settings
        if self.observed >= settings.ttl_samples and self._since_solved >= min(
            _SOLVE_EVERY, settings.ttl_samples
        ):
            self._since_solved = 0
            ordered = sorted(self._lengths)
            learned = ordered[min(int(settings.ttl_quantile * len(ordered)), len(ordered) - 1)]
            self.ttl_s = min(max(learned, settings.ttl_min_s), settings.ttl_max_s)
