"""How long an agent's tool calls last: the time-to-live a program's KV is worth keeping between turns."""

from __future__ import annotations

from collections import deque

from router.programs.settings import ProgramsConfig

WINDOW = 1024  # the tool calls the quantile is taken over: the latest, so that it follows the workload
_SOLVE_EVERY = 16  # calls observed between two sorts of the window
_COME_BACK_SAMPLES = 20  # tool calls ended before whether programs come back is told from them


class ToolCalls:
    """The lengths of the latest tool calls (a turn's answer to the program's next turn), and the
    time-to-live learned from them: a quantile, clamped, or the prior until enough were seen. And whether
    programs come back after a turn at all: agents do, turn after turn; a one-shot question under a session
    key (a RAG user) does not."""

    def __init__(self, settings: ProgramsConfig) -> None:
        self._settings = settings
        self._lengths: deque[float] = deque(maxlen=WINDOW)
        self._since_solved = 0
        self.ttl_s = settings.ttl_prior_s
        self.observed = 0
        self._outcomes: deque[bool] = deque(maxlen=WINDOW)  # the latest turns' ends: came back or lapsed
        self._came_back = 0  # of those, how many came back

    @property
    def come_back(self) -> bool:
        """Whether most of the latest programs came back for another turn within their time-to-live (yes,
        the prior, until a few were seen: a majority shows in fewer samples than a quantile)."""
        seen = len(self._outcomes)
        return seen < _COME_BACK_SAMPLES or 2 * self._came_back >= seen

    def tool_call_ended(self, next_turn: bool) -> None:
        """A program's tool call ended with its next turn, or with its time-to-live (not next_turn)."""
        if len(self._outcomes) == WINDOW:
            self._came_back -= self._outcomes[0]
        self._outcomes.append(next_turn)
        self._came_back += next_turn

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
