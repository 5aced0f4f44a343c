"""Requests wait in the router while no instance has KV memory for them, then go where memory frees first.

An engine admits a prompt only when its context fits beside those in flight, so a request sent to a full
instance waits for that instance alone. Held in the router instead, it is routed when a request ends
anywhere and some instance has room: one queue for the fleet instead of one per engine, and the decision is
made on fresher state. A request that fits passes those that do not (first fit: in simulation, letting
nothing pass the oldest cost more than it saved), and none is held longer than the bound, after which it is
routed as if there were no hold (the proxy times each hold; the simulation, which has no timers, lets an
expired one go at the next request's end). Room is counted about as the engine counts it: the part of a
prompt that requests in flight on an instance already hold takes no more memory there, in grains of ~512
tokens (router/upstreams/inflight_blocks.py); what was let go counts whole until it is in flight (cautious).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from router.upstreams.instances import Instance

T = TypeVar("T")
Candidates = Callable[[], Sequence[Instance]]


@dataclass(eq=False, slots=True)
class _Held(Generic[T]):
    item: T
    prompt_tokens: int
    chain: Sequence[int]
    candidates: Candidates
    since: float


class MemoryGate(Generic[T]):
    def __init__(self, max_hold_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        """max_hold_s: the longest a request is held; 0 turns the hold off."""
        self.max_hold_s, self._clock = max_hold_s, clock
        self._held: list[_Held[T]] = []  # in arrival order
        self._granted = 0  # prompt tokens let go and not yet counted in flight on an instance

    def __len__(self) -> int:
        return len(self._held)

    @property
    def enabled(self) -> bool:
        return self.max_hold_s > 0

    def must_wait(
        self, prompt_tokens: int, candidates: Sequence[Instance], chain: Sequence[int] = ()
    ) -> bool:
        """The hold is on, no candidate has room for this prompt (its whole blocks hash to chain) now, and
        one would when empty (a prompt larger than every instance's memory would only wait out the bound)."""
        if not self.enabled or self._fits(prompt_tokens, chain, candidates):
            return False
        largest = max((i.kv_capacity_tokens or 0 for i in candidates), default=0)
        return prompt_tokens <= largest

    def hold(self, item: T, prompt_tokens: int, candidates: Candidates, chain: Sequence[int] = ()) -> None:
        self._held.append(_Held(item, prompt_tokens, chain, candidates, self._clock()))

    def drop(self, item: T) -> None:
        """item leaves without being released (its client went away, or it stopped waiting)."""
        self._held = [held for held in self._held if held.item is not item]

    def release(self) -> list[T]:
        """The held requests that may go now, in arrival order: call it whenever a request ends. Their
        prompts count against the room left until started() says they are in flight."""
        now = self._clock()
        going: list[T] = []
        kept: list[_Held[T]] = []
        for held in self._held:
            expired = now - held.since >= self.max_hold_s
            if expired or self._fits(held.prompt_tokens, held.chain, held.candidates()):
                self._granted += held.prompt_tokens
                going.append(held.item)
            else:
                kept.append(held)
        self._held = kept
        return going

    def started(self, prompt_tokens: int) -> None:
        """A released request was counted in flight on its instance (or gave up): it no longer holds room."""
        self._granted -= prompt_tokens

    def _fits(self, prompt_tokens: int, chain: Sequence[int], candidates: Sequence[Instance]) -> bool:
        """Some candidate's capacity, less its contexts in flight, less what was let go and is not yet in
        flight anywhere (one tally for every instance and model: cautious, and it clears as soon as the
        released requests start), takes the part of the prompt it does not hold already; an instance whose
        capacity is unknown always does."""
        granted = self._granted
        for instance in candidates:
            capacity = instance.kv_capacity_tokens
            if not capacity:
                return True
            room = capacity - instance.active_tokens - granted
            # What requests in flight share of the prompt is looked up only when the whole would not fit.
            if room >= prompt_tokens or room >= prompt_tokens - instance.shared_tokens(chain):
                return True
        return not candidates
