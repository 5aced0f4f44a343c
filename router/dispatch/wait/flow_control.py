"""Flow control: a request that no instance can take without queueing waits in the router, and is placed when
one has room, in an order that lowers the median and bounds the tail, by priority and fairly between flows.

The proxy and the simulator drive the same object: admit() on arrival says whether the request goes now or
waits (or is refused: a limit, with the seconds a client should wait); whenever room may have appeared (a
first byte, an end, a peer's change) the caller takes next_ready() until it answers None, places each, and
tells placed(); ended() when a placed request is over. A waiter that is let go counts as granted until
placed: its predicted work and context are counted on every instance while room is looked for, so the room
it takes is not handed out twice, and several may go at once (the proxy places each in its own task, a turn
or more of the event loop later). Ordering is router/dispatch/wait/flow_queue.py's,
saturation router/dispatch/wait/saturation.py's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from router.dispatch.wait.flow_queue import FlowQueue, Queued
from router.dispatch.wait.flows_elsewhere import FlowsElsewhere, flow_key, objective_key
from router.dispatch.wait.saturation import Saturation
from router.dispatch.wait.settings import FlowControlConfig, ObjectiveConfig

T = TypeVar("T")
# Whether some instance may take a request now, with (uncached tokens, context tokens) of requests let go and
# not yet placed assumed on it as well.
Room = Callable[[float, int], bool]
DEFAULT_FLOW = "default"

# Buckets and in-flight counts of flows that went quiet are forgotten past this many.
_FLOWS_KEPT = 16384


class Refused(Exception):
    """Not admitted: code says which limit, retry_after_s when a client may try again."""

    def __init__(self, code: str, retry_after_s: int) -> None:
        super().__init__(code)
        self.code, self.retry_after_s = code, retry_after_s


@dataclass(slots=True)
class _Bucket:
    """Tokens a second, with a second's burst; a request may overdraw it, and the next waits until it is
    back to zero."""

    rate: float
    level: float
    at: float

    def wait_s(self, now: float) -> float:
        """Refilled to now: the seconds until a request may be taken (0: now)."""
        self.level = min(self.rate, self.level + (now - self.at) * self.rate)
        self.at = now
        return -self.level / self.rate if self.level < 0 else 0.0


@dataclass(slots=True)
class _Granted:
    """A model's requests let go from the queue and not yet placed: how many, their predicted uncached tokens
    and their context tokens."""

    requests: int = 0
    work: float = 0.0
    tokens: int = 0

    def add(self, work: float, tokens: int) -> None:
        self.requests += 1
        self.work += work
        self.tokens += tokens

    def placed(self, work: float, tokens: int) -> None:
        if self.requests <= 1:  # the last: no sum of floats left over
            self.requests, self.work, self.tokens = 0, 0.0, 0
            return
        self.requests -= 1
        self.work = max(self.work - work, 0.0)
        self.tokens = max(self.tokens - tokens, 0)


@dataclass(slots=True)  # not frozen: one is made per request
class Demand:
    """What one request asks of flow control: a model's instances, on behalf of a flow and an objective."""

    model: str
    flow: str
    objective: str | None  # as the request names it (None or an unknown one: the default)
    work: float  # what it adds to its instance's queue (its uncached prompt tokens at best)
    tokens: int  # its prompt's tokens (the rate limits' and the context's count)


class FlowControl(Generic[T]):
    def __init__(self, config: FlowControlConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._queues: dict[str, FlowQueue[T]] = {}  # by model
        self._rooms: dict[str, Room] = {}
        self._granted: dict[str, _Granted] = {}  # by model: let go, not placed yet
        self._in_flight_flow: dict[str, int] = {}
        self._in_flight_objective: dict[str, int] = {}
        self._buckets: dict[str, _Bucket] = {}
        # Peer routers' counts (router/dispatch/wait/flows_elsewhere.py), and the tokens charged here since
        # they were last told (kept only once they are: shared()).
        self.elsewhere = FlowsElsewhere()
        self._sent_tokens: dict[str, int] | None = None
        # Told when a request is let go into a flow or objective at half its limit in flight or more: peers
        # are told at once, not an interval later, so that two routers rarely let go into the same last
        # slots (PeerSync.nudge).
        self.on_taken: Callable[[], None] | None = None
        self.configure(config)

    def configure(self, config: FlowControlConfig) -> None:
        """A reload: the queues and counts stay, the limits and ordering from now on are config's."""
        self.config = config
        self.saturation = Saturation(config.engine_queue_s, config.kv_usage)
        for queue in self._queues.values():
            queue.ordering = config.ordering
            queue.aging_tokens_per_s = config.aging_tokens_per_s
            queue.flow_share_tokens_per_s = config.flow_share_tokens_per_s

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def queued(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def queues(self) -> dict[str, FlowQueue[T]]:
        """The queues by model."""
        return self._queues

    def queued_by_objective(self, objective: str) -> int:
        return sum(q.by_objective.get(objective, 0) for q in self._queues.values())

    def queued_by_flow(self, flow: str) -> int:
        return sum(q.by_flow.get(flow, 0) for q in self._queues.values())

    def admit(self, item: T, demand: Demand, room: Room) -> Queued[T] | None:
        """None: go now (counted in flight); else the entry it waits as, until next_ready() lets it go or
        its deadline passes. Raises Refused past a limit. room: whether the model's instances have room now,
        with the work and context of those let go and not yet placed on them as well."""
        model, flow, work, tokens = demand.model, demand.flow, demand.work, demand.tokens
        name, settings = self.config.objective(demand.objective)
        buckets = self._within_rate(flow, name, settings)
        queue = self._queue(model)
        self._rooms[model] = room
        if not len(queue) and not self._at_limit(flow, name) and self._has_room(model, room):
            self._charge(buckets, tokens)
            self._count(flow, name, 1)
            return None
        if queue.by_objective.get(name, 0) >= settings.max_queued:
            raise Refused("queue_full", math.ceil(settings.max_queue_s))
        per_flow = self.config.per_flow.max_queued
        if per_flow is not None and queue.by_flow.get(flow, 0) >= per_flow:
            raise Refused("flow_queue_full", math.ceil(settings.max_queue_s))
        self._charge(buckets, tokens)
        now = self._clock()
        deadline = now + settings.max_queue_s
        entry = Queued(item, flow, name, settings.priority, work, now, deadline, model, tokens=tokens)
        queue.add(entry)
        return entry

    def next_ready(self) -> Queued[T] | None:
        """The next waiter that may go now, taken off its queue and counted in flight (the caller places it
        and calls placed()), or None."""
        for model, queue in self._queues.items():
            if not len(queue) or not self._has_room(model, self._rooms[model]):
                continue
            for head in queue.heads(lambda flow: self._flow_at_limit(flow)):
                if self._objective_at_limit(head.objective):
                    continue
                queue.dispatched(head)
                granted = self._granted.get(model)
                if granted is None:
                    granted = self._granted[model] = _Granted()
                granted.add(head.work, head.tokens)
                self._count(head.flow, head.objective, 1)
                return head
        return None

    def placed(self, entry: Queued[T]) -> None:
        """A waiter let go has been counted at its instance (or gave up): the room it took is accounted."""
        granted = self._granted.get(entry.model)
        if granted is not None:
            granted.placed(entry.work, entry.tokens)

    def _has_room(self, model: str, room: Room) -> bool:
        granted = self._granted.get(model)
        return room(0.0, 0) if granted is None else room(granted.work, granted.tokens)  # 0s once all placed

    def ended(self, flow: str, objective: str) -> None:
        """A request admitted or let go is over."""
        self._count(flow, objective, -1)

    def leave(self, entry: Queued[T]) -> None:
        """entry stops waiting (its client left, or its deadline passed)."""
        queue = self._queues.get(entry.model)
        if queue is not None:
            queue.remove(entry)

    def expired(self) -> list[Queued[T]]:
        """The waiters past their deadline, taken off their queues: each is refused."""
        gone = [entry for queue in self._queues.values() for entry in queue.expired()]
        for entry in gone:
            self.leave(entry)
        return gone

    def _queue(self, model: str) -> FlowQueue[T]:
        queue = self._queues.get(model)
        if queue is None:
            config = self.config
            queue = self._queues[model] = FlowQueue(
                config.ordering, config.aging_tokens_per_s, config.flow_share_tokens_per_s, self._clock
            )
        return queue

    def _within_rate(self, flow: str, objective: str, settings: ObjectiveConfig) -> list[tuple[str, _Bucket]]:
        """The objective's and the flow's buckets, to charge once the request is admitted; Refused when one
        is overdrawn (nothing is charged for a request refused)."""
        now = self._clock()
        limits = (
            (objective_key(objective), settings.tokens_per_s),
            (flow_key(flow), self.config.per_flow.tokens_per_s),
        )
        buckets = [(key, self._bucket(key, rate, now)) for key, rate in limits if rate is not None]
        wait_s = max((bucket.wait_s(now) for _, bucket in buckets), default=0.0)
        if wait_s:
            raise Refused("rate_limited", max(1, math.ceil(wait_s)))
        return buckets

    def _charge(self, buckets: list[tuple[str, _Bucket]], tokens: int) -> None:
        sent = self._sent_tokens
        for key, bucket in buckets:
            bucket.level -= tokens
            if sent is not None:
                sent[key] = sent.get(key, 0) + tokens

    def shared(self) -> dict[str, tuple[int, int]]:
        """What peer routers are told (router/upstreams/peer_sync.py): each limited flow's and objective's
        requests in flight here and the prompt tokens charged since the last call."""
        sent, self._sent_tokens = self._sent_tokens or {}, {}
        told: dict[str, tuple[int, int]] = {}
        if self.config.per_flow.max_in_flight is not None:
            told.update((flow_key(flow), (n, 0)) for flow, n in self._in_flight_flow.items())
        objectives = self.config.objectives
        for objective, n in self._in_flight_objective.items():
            if self.config.objective(objective)[1].max_in_flight is not None and objective in objectives:
                told[objective_key(objective)] = (n, 0)
        for key, tokens in sent.items():
            told[key] = (told.get(key, (0, 0))[0], tokens)
        return told

    def heard(self, peer: str, flows: dict[str, tuple[int, int]]) -> None:
        """A peer's counts: its requests in flight count against the limits here, and the tokens it sent
        are taken from the buckets here."""
        self.elsewhere.heard(peer, {key: n for key, (n, _) in flows.items()})
        now = self._clock()
        for key, (_, tokens) in flows.items():
            rate = self._rate_of(key)
            if tokens and rate is not None:
                self._bucket(key, rate, now).level -= tokens

    def forget(self, peer: str) -> None:
        self.elsewhere.forget(peer)

    def _rate_of(self, key: str) -> float | None:
        kind, _, name = key.partition(":")
        if kind == "flow":
            return self.config.per_flow.tokens_per_s
        if kind == "objective" and name in self.config.objectives:
            return self.config.objectives[name].tokens_per_s
        return None

    def _bucket(self, key: str, rate: float, now: float) -> _Bucket:
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) > _FLOWS_KEPT:  # those refilled to a burst are as good as new
                self._buckets = {
                    k: b for k, b in self._buckets.items() if b.level + (now - b.at) * b.rate < b.rate
                }
            bucket = self._buckets[key] = _Bucket(rate, rate, now)
        bucket.rate = rate  # a reload may have changed it
        return bucket

    def limits_in_flight(self, flow: str, objective: str) -> list[tuple[str, int]]:
        """The flow's and the objective's limits on requests in flight, where set: (flow_key or
        objective_key, limit)."""
        limits = []
        flow_limit = self.config.per_flow.max_in_flight
        if flow_limit is not None:
            limits.append((flow_key(flow), flow_limit))
        objective_limit = self.config.objective(objective)[1].max_in_flight
        if objective_limit is not None:
            limits.append((objective_key(objective), objective_limit))
        return limits

    def _at_limit(self, flow: str, objective: str) -> bool:
        return self._flow_at_limit(flow) or self._objective_at_limit(objective)

    def _near_limit(self, flow: str, objective: str) -> bool:
        """Whether the flow or the objective, limited in flight, holds half its limit or more with its peers'
        requests: where two routers letting requests go at once could pass it. Far below, peers hear of a
        request at the interval, at no cost."""
        limit = self.config.per_flow.max_in_flight
        in_flight = self._in_flight_flow.get(flow, 0) + self.elsewhere.in_flight(flow_key(flow))
        if limit is not None and 2 * in_flight >= limit:
            return True
        limit = self.config.objective(objective)[1].max_in_flight
        in_flight = self._in_flight_objective.get(objective, 0)
        return (
            limit is not None
            and 2 * (in_flight + self.elsewhere.in_flight(objective_key(objective))) >= limit
        )

    def _flow_at_limit(self, flow: str) -> bool:
        limit = self.config.per_flow.max_in_flight
        if limit is None:
            return False
        return self._in_flight_flow.get(flow, 0) + self.elsewhere.in_flight(flow_key(flow)) >= limit

    def _objective_at_limit(self, objective: str) -> bool:
        limit = self.config.objective(objective)[1].max_in_flight
        if limit is None:
            return False
        in_flight = self._in_flight_objective.get(objective, 0)
        return in_flight + self.elsewhere.in_flight(objective_key(objective)) >= limit

    def _count(self, flow: str, objective: str, change: int) -> None:
        for counts, key in ((self._in_flight_flow, flow), (self._in_flight_objective, objective)):
            left = counts.get(key, 0) + change
            if left > 0:
                counts[key] = left
            else:
                counts.pop(key, None)
        if change > 0 and self.on_taken is not None and self._near_limit(flow, objective):
            self.on_taken()
