"""Flow control's in-flight limits held on the shared store, so that a tenant's limit is strict across
replicas.

Peers' snapshots tell each replica the others' requests in flight, but a snapshot is in transit for a moment:
two replicas that each let a request go into the last slot within it would pass the limit together. So a
replica that lets go a request of a flow or objective limited in flight first takes a slot for it on the
store, in one atomic script: the slot is granted only while every live replica's slots of that key are fewer
than its limit. A refused request waits for a slot to free (router/dispatch/wait/flow_gate.py).

Each key's slots are one hash on the store, a count per replica. A replica's slots count while its lease
lives: it renews the lease (and writes its counts again, whatever was lost) every ``renew_s``; a replica
that dies leaves its slots to expire with its lease, ``lease_s`` later, and the next take drops them. While
the store does not answer, a replica lets its requests go on what it knows (as alone) and counts them as
its slots; its counts are written when the store is back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from router.shared.store import SharedStore, StoreError

# One round for a batch (KEYS unused: one store, not a cluster). ARGV: this replica, the leases' key prefix,
# the lease in ms; the number of counts to write, then each (key, this replica's count: 0 drops its field);
# then takes, each its number of keys and (key, limit) pairs. Writes go first; each take gets a slot of every
# key or none, in order. Answers each take's 0 (taken) or the 1-based index of its first key at its limit.
_ROUND = """
local owner, prefix, lease = ARGV[1], ARGV[2], tonumber(ARGV[3])
redis.call('SET', prefix .. owner, 1, 'PX', lease)
local at = 5
for _ = 1, tonumber(ARGV[4]) do
  local key, n = ARGV[at], tonumber(ARGV[at + 1])
  if n > 0 then
    redis.call('HSET', key, owner, n)
    redis.call('PEXPIRE', key, lease)
  else
    redis.call('HDEL', key, owner)
  end
  at = at + 2
end
local answers = {}
while at <= #ARGV do
  local count, full = tonumber(ARGV[at]), 0
  for i = 1, count do
    local key, limit = ARGV[at + 2 * i - 1], tonumber(ARGV[at + 2 * i])
    local held, total = redis.call('HGETALL', key), 0
    for j = 1, #held, 2 do
      if held[j] == owner or redis.call('EXISTS', prefix .. held[j]) == 1 then
        total = total + tonumber(held[j + 1])
      else
        redis.call('HDEL', key, held[j])
      end
    end
    if full == 0 and total >= limit then full = i end
  end
  if full == 0 then
    for i = 1, count do
      redis.call('HINCRBY', ARGV[at + 2 * i - 1], owner, 1)
      redis.call('PEXPIRE', ARGV[at + 2 * i - 1], lease)
    end
  end
  answers[#answers + 1] = full
  at = at + 2 * count + 1
end
return answers
"""

# A lease outlives this many renewals missed (a replica's loop held up), so that a busy replica keeps its
# slots; a dead one's free this long after its last renewal.
LEASE_RENEWALS = 6


@dataclass(slots=True)
class _Take:
    keys: list[str]
    limits: list[int]
    answer: asyncio.Future[bool]


class SharedSlots:
    def __init__(self, store: SharedStore, owner: str) -> None:
        """owner: this replica's id (PeerSync.router_id), drawn at start: restarted, it holds nothing."""
        self._store, self._owner = store, owner
        self.renew_s = store.config.stale_after_s / 2
        self._lease_ms = round(self.renew_s * LEASE_RENEWALS * 1000)
        self._prefix = store.key("slot-lease", "")
        self._round = store.client.register_script(_ROUND)
        self._held: dict[str, int] = {}  # key -> slots held here
        # What the next round carries: the keys whose count here must be written, the takes asked for. One
        # round at a time, so that a count written whole never overtakes a take (a batch under load: the
        # requests that arrive during a round share the next).
        self._dirty: set[str] = set()
        self._takes: list[_Take] = []
        self._unwritten: set[str] = set()  # counts a failed round did not write: written at the next renewal
        self._lease_due = False
        self._rounds: asyncio.Task[None] | None = None

    def key(self, limited: str) -> str:
        """The store's hash of a flow's or objective's slots (limited: flow_key, objective_key)."""
        return self._store.key("slots", limited)

    def held(self, limited: str) -> int:
        return self._held.get(limited, 0)

    async def take(self, limits: Sequence[tuple[str, int]]) -> bool:
        """A slot of each (key, limit), all or none: False when another replica holds the last of one. While
        the store does not answer (or is known not to), True: the request goes on what this replica knows."""
        keys = [key for key, _ in limits]
        if self._store.known_down:  # no request waits on a store known away: publishing finds it back
            for key in keys:
                self._held[key] = self._held.get(key, 0) + 1
            self._unwritten.update(keys)
            return True
        answer: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._takes.append(_Take(keys, [limit for _, limit in limits], answer))
        self._go()
        return await answer

    def give_back(self, keys: Sequence[str]) -> None:
        """The request that took these slots is over: written in the next round."""
        held = self._held
        for key in keys:
            left = held.get(key, 0) - 1
            if left > 0:
                held[key] = left
            else:
                held.pop(key, None)
        self._dirty.update(keys)
        self._go()

    async def renew(self) -> None:
        """Every renew_s: the lease renewed, with every count held here written whole (a give-back lost while
        the store was away is mended). Holding none, the lease may lapse: the next take sets it again."""
        if self._held or self._unwritten:
            self._dirty.update(self._held)
            self._dirty.update(self._unwritten)
            self._unwritten.clear()
            self._lease_due = True
            self._go()
            await self.settled()

    async def settled(self) -> None:
        """Once every take and give-back asked for so far has been to the store."""
        while (rounds := self._rounds) is not None:
            await asyncio.shield(rounds)

    def _go(self) -> None:
        if self._rounds is None:
            self._rounds = asyncio.get_running_loop().create_task(self._run_rounds())

    async def _run_rounds(self) -> None:
        try:
            while self._takes or self._dirty or self._lease_due:
                await self._one_round()
        finally:
            self._rounds = None

    async def _one_round(self) -> None:
        takes, self._takes = self._takes, []
        dirty, self._dirty = self._dirty, set()
        self._lease_due = False
        held, store = self._held, self._store
        args: list[str | int] = [self._owner, self._prefix, self._lease_ms, len(dirty)]
        for key in dirty:
            args += (self.key(key), held.get(key, 0))
        for take in takes:
            args.append(len(take.keys))
            for key, limit in zip(take.keys, take.limits, strict=True):
                args += (self.key(key), limit)
        try:
            answers = await self._round(args=args)
            store.answered()
        except StoreError as exc:  # the takes go on what this replica knows; its counts are written later
            store.failed("slots", exc)
            answers = [0] * len(takes)
            self._unwritten.update(dirty, *(take.keys for take in takes))
        except asyncio.CancelledError:  # the router stops
            self._unwritten.update(dirty, *(take.keys for take in takes))
            for take in takes:
                take.answer.cancel()
            raise
        for take, full in zip(takes, answers, strict=True):
            if full:
                if not take.answer.done():
                    take.answer.set_result(False)
                continue
            for key in take.keys:
                held[key] = held.get(key, 0) + 1
            if take.answer.done():  # its request left while it was asked for: given back at once
                self.give_back(take.keys)
            else:
                take.answer.set_result(True)
