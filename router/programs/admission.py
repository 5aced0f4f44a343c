"""Admission by program: a new agent program waits in the router while the working sets alive fill every
instance's KV cache, so that it does not evict the context a program in a tool call comes back for.

An instance's KV cache is taken as full for a new program when its working sets (router/programs/table.py;
or its contexts in flight, when more) and the program's prompt pass `start_below` of its capacity. A
program's later turns never wait here: only a request whose program is not alive when it comes to the gate,
a program new, or one back after its working set lapsed or was paused. Those back go first, and
among each kind the first come; one that fits passes those that do not, and none waits longer than
`max_wait_s`, after which it goes as if there were no gate (the proxy times each wait; the simulation lets an
expired one go at its next look for room). A program let go from the queue has its prompt counted at the
instance with the most room until its turn is counted in the working sets (counted()), so the room one takes
is not handed out twice to those let go with it; one not counted within `max_wait_s` (its client left, or no
instance took it) holds none after. One that goes at once is counted as a context in flight where it goes,
and not as well: reserving its room too held more programs back for longer (16 instances at load 0.9, the
simulated programs trace: TTFT p99 4.99 s, against 4.52 s).

The proxy and the simulator drive the same object: goes_now() and, if not, hold() on arrival; release()
whenever room may have appeared (and every PROGRAM_TICK_S while programs wait: a tool call's time-to-live
lapses on no event); counted() once the program's turn started or gave up.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from router.upstreams.instances import Instance
from scorers.program_room import kv_in_use

T = TypeVar("T")
Candidates = Callable[[], Sequence[Instance]]


@dataclass(eq=False, slots=True)
class _Waiting(Generic[T]):
    item: T
    key: str
    prompt_tokens: int
    candidates: Candidates
    since: float


class ProgramGate(Generic[T]):
    def __init__(
        self, start_below: float | None, max_wait_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """start_below: the share of an instance's KV cache the working sets may fill with a new program's
        prompt (None: the gate is off); max_wait_s: the longest a new program waits."""
        self.start_below, self.max_wait_s, self._clock = start_below, max_wait_s, clock
        self._back: list[_Waiting[T]] = []  # programs back after their working set lapsed, in arrival order
        self._new: list[_Waiting[T]] = []  # new programs, in arrival order
        # By program, in the order let go: (instance, tokens, when) of those let go and not counted yet.
        self._granted: dict[str, tuple[str, int, float]] = {}
        self._granted_at: dict[str, int] = {}  # by instance: the tokens of those

    def __len__(self) -> int:
        return len(self._back) + len(self._new)

    @property
    def enabled(self) -> bool:
        return self.start_below is not None and self.max_wait_s > 0

    def waiting(self) -> dict[str, int]:
        """The programs waiting now, by kind: back, new."""
        return {"back": len(self._back), "new": len(self._new)}

    def goes_now(self, prompt_tokens: int, candidates: Sequence[Instance]) -> bool:
        """Whether the program's first turn (prompt_tokens) goes now: the gate is off, or none waits before
        it and some candidate has room for it (or none ever would: a prompt larger than every instance's
        share would only wait out the bound). Else it waits (hold())."""
        if not self.enabled:
            return True
        self._forget_stale_grants(self._clock())
        if len(self):
            return False  # it takes its turn after those waiting
        if self._roomiest(prompt_tokens, candidates) is not None:
            return True
        return not self._could_fit(prompt_tokens, candidates)

    def hold(self, item: T, key: str, prompt_tokens: int, candidates: Candidates, back: bool) -> None:
        """back: the program was followed before (its working set lapsed or was paused)."""
        waiting = _Waiting(item, key, prompt_tokens, candidates, self._clock())
        (self._back if back else self._new).append(waiting)

    def drop(self, item: T) -> None:
        """item leaves without being released (its client went away)."""
        self._back = [w for w in self._back if w.item is not item]
        self._new = [w for w in self._new if w.item is not item]

    def release(self) -> list[T]:
        """The waiting programs that may go now: those back first, then the new, each in arrival order."""
        now = self._clock()
        self._forget_stale_grants(now)
        going: list[T] = []
        self._back = self._released(self._back, now, going)
        self._new = self._released(self._new, now, going)
        return going

    def counted(self, key: str | None) -> None:
        """The program's turn is counted in its instance's working set now, or gave up: its prompt no longer
        holds room here."""
        granted = None if key is None else self._granted.pop(key, None)
        if granted is None:
            return
        name, tokens, _ = granted
        left = self._granted_at.get(name, 0) - tokens
        if left > 0:
            self._granted_at[name] = left
        else:
            self._granted_at.pop(name, None)

    def _released(self, queue: list[_Waiting[T]], now: float, going: list[T]) -> list[_Waiting[T]]:
        kept: list[_Waiting[T]] = []
        for waiting in queue:
            candidates = waiting.candidates()
            roomiest = self._roomiest(waiting.prompt_tokens, candidates)
            if roomiest is None and now - waiting.since < self.max_wait_s:
                kept.append(waiting)
                continue
            if roomiest is not None:
                self._grant(waiting.key, roomiest.name, waiting.prompt_tokens, now)
            going.append(waiting.item)
        return kept

    def _grant(self, key: str, name: str, tokens: int, now: float) -> None:
        self.counted(key)  # a program's one turn at a time holds room
        self._granted[key] = name, tokens, now
        self._granted_at[name] = self._granted_at.get(name, 0) + tokens

    def _forget_stale_grants(self, now: float) -> None:
        while self._granted:
            key, (_, _, at) = next(iter(self._granted.items()))
            if now - at < self.max_wait_s:
                break
            self.counted(key)

    def _roomiest(self, prompt_tokens: int, candidates: Sequence[Instance]) -> Instance | None:
        """The candidate whose working sets leave the most room, if that takes the prompt under start_below
        of its cache; an instance whose capacity is unknown takes any."""
        assert self.start_below is not None
        best, best_room = None, 0.0
        for instance in candidates:
            capacity = instance.kv_capacity_tokens
            if not capacity:
                return instance
            room = self.start_below * capacity - kv_in_use(instance) - self._granted_at.get(instance.name, 0)
            if room >= prompt_tokens and (best is None or room > best_room):
                best, best_room = instance, room
        return best

    def _could_fit(self, prompt_tokens: int, candidates: Sequence[Instance]) -> bool:
        """Some candidate would take the prompt with no program alive (a larger one would only wait out the
        bound)."""
        assert self.start_below is not None
        largest = max((i.kv_capacity_tokens or 0 for i in candidates), default=0)
        return prompt_tokens <= self.start_below * largest
