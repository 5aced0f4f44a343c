"""A multi-turn agentic workload: sessions that resend a growing history every turn.

Every session starts with the same system prompt (as agents of one product do), then each turn appends a
user (tool output) message and the assistant's reply, so turn N's prompt holds turns 1..N-1 verbatim.
"""

from __future__ import annotations

import base64
import io
import random
from dataclasses import dataclass

from PIL import Image

_WORDS = (
    "def return class import self test assert error file line value request response cache block token "
    "prefix instance router queue load session turn patch diff commit branch merge build run pass fail "
    "module function parser client server config yaml json event index score pick stream chunk retry"
).split()


@dataclass(frozen=True)
class AgentWorkload:
    sessions: int = 8
    turns: int = 6
    system_prompt_words: int = 400
    min_turn_words: int = 60
    max_turn_words: int = 180
    max_tokens: int = 16
    think_time_s: float = 0.05
    # Up to this much more after each turn, drawn from the seed: tool calls take varying time, which keeps
    # sessions that start together from sending their turns together.
    think_time_jitter_s: float = 0.0
    seed: int = 0
    # Every this many turns (0: none), the user's message carries a screenshot: a PNG of its own, sent inline
    # (a data: URL), of a size drawn from the seed.
    image_every: int = 0

    def system_prompt(self) -> str:
        rng = random.Random(f"{self.seed}:system")
        return "You are a coding agent. Tools: " + _text(rng, self.system_prompt_words)

    def user_message(self, session: int, turn: int) -> str:
        rng = random.Random(f"{self.seed}:{session}:{turn}")
        return f"[session {session} turn {turn}] tool output: " + _text(
            rng, rng.randint(self.min_turn_words, self.max_turn_words)
        )

    def image(self, session: int, turn: int) -> str | None:
        """The screenshot the turn's message carries, as a data: URL; None for most turns."""
        if not self.image_every or turn % self.image_every != self.image_every - 1:
            return None
        rng = random.Random(f"{self.seed}:{session}:{turn}:image")
        width, height = rng.randint(48, 200), rng.randint(48, 160)
        png = io.BytesIO()
        Image.frombytes("RGB", (width, height), rng.randbytes(width * height * 3)).save(png, "PNG")
        return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()

    def think_time(self, session: int, turn: int) -> float:
        """The pause after a turn, before the next."""
        if not self.think_time_jitter_s:
            return self.think_time_s
        rng = random.Random(f"{self.seed}:{session}:{turn}:think")
        return self.think_time_s + rng.uniform(0.0, self.think_time_jitter_s)

    @property
    def requests(self) -> int:
        return self.sessions * self.turns


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))
