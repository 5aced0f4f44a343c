"""Where a request waits its turn in the proxy and the endpoint picker: flow control (router/dispatch/
flow_control.py) driven by the event loop.

A waiter is a future. pump(), called whenever room may have appeared (a first byte, an end, a peer router's
change), resolves the futures of those that may go: each one let go counts as granted (its work taken as
already on the instances) until its attempt is counted at its instance. The caller says when it is about to
start it (started(): no await between that and Outcome.start, which is synchronous, so placed() runs with
call_soon after it), and leave() covers every way out before that.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from functools import partial

import xxhash

from router.apis.routes import KEY_HEADERS
from router.dispatch.context import FlowTicket
from router.dispatch.wait.flow_control import DEFAULT_FLOW, Demand, FlowControl, Refused
from router.dispatch.wait.flow_queue import Queued
from router.dispatch.wait.settings import FlowControlConfig
from router.errors import OpenAIError, too_many_requests
from router.metrics import RouterMetrics
from router.shared.slots import SharedSlots
from router.upstreams.instances import Upstreams

Waiter = asyncio.Future[None]

# Flows with a queue-length series of their own at once: those with requests queued now, the first to queue
# while fewer than this many have one; the others' are counted under OTHER_FLOWS. A label is at most
# FLOW_LABEL_CHARS long (a longer flow's is cut, with a digest of it).
FLOW_SERIES = 100
FLOW_LABEL_CHARS = 64
OTHER_FLOWS = "other"
# A request waiting for a slot another replica holds asks the store again when room may have appeared here
# (a peer's snapshot, an end), and at least this often.
SLOT_RETRY_S = 0.05


def flow_of(config: FlowControlConfig, headers: Mapping[str, str], session: str | None) -> str:
    """The flow a request belongs to: a fairness header, else its session, else its client's API key (as
    a digest), else the one default flow."""
    for header in config.fairness_headers:
        named = headers.get(header)
        if named:
            return named
    if session is not None:
        return f"session:{session}"
    for header in KEY_HEADERS:
        key = headers.get(header)
        if key:
            return f"key:{xxhash.xxh3_64_hexdigest(key.encode())}"
    return DEFAULT_FLOW


def flow_label(flow: str) -> str:
    """flow as a label value: itself, or, when longer than FLOW_LABEL_CHARS, its start and a digest."""
    if len(flow) <= FLOW_LABEL_CHARS:
        return flow
    digest = xxhash.xxh3_64_hexdigest(flow.encode())
    return f"{flow[: FLOW_LABEL_CHARS - len(digest) - 1]}~{digest}"


def objective_of(config: FlowControlConfig, headers: Mapping[str, str]) -> str | None:
    for header in config.objective_headers:
        named = headers.get(header)
        if named:
            return named
    return None


class FlowGate:
    def __init__(
        self,
        config: FlowControlConfig,
        upstreams: Upstreams,
        metrics: RouterMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """clock: what its queue's waits are timed by, as asyncio's loop times them (a simulated router's
        runs on the trace's clock)."""
        self.control: FlowControl[Waiter] = FlowControl(config, clock)
        self.clock = clock
        self._upstreams, self._metrics = upstreams, metrics
        self._labelled: dict[str, str] = {}  # the flows with a series of their own now: their labels
        # Replicas sharing a store: the limits in flight held there (set by the runtime, with the store).
        self.slots: SharedSlots | None = None
        self._may_take = asyncio.Event()  # set (and replaced) whenever room may have appeared
        self._slot_waiting = 0  # requests waiting for another replica's slot

    @property
    def config(self) -> FlowControlConfig:
        return self.control.config

    def room(self, model: str, extra_work: float = 0.0, extra_tokens: int = 0) -> bool:
        """Whether some instance of model may take a request now (each stage of a disaggregated one), with
        extra_work and extra_tokens (of requests let go, not yet placed) on it as well."""
        upstreams, saturation = self._upstreams, self.control.saturation
        if upstreams.disaggregated(model):
            prefill = upstreams.candidates(model, leg="prefill")
            return saturation.stages_have_room(prefill, upstreams.candidates(model), extra_work, extra_tokens)
        return saturation.has_room(upstreams.candidates(model), extra_work, extra_tokens)

    async def wait(self, demand: Demand) -> FlowTicket | None:
        """Wait for the request's turn: its ticket (ended by leave()), or None when flow control is off;
        a 429 in the route's shape past a limit or its objective's queue time."""
        control = self.control
        if not control.enabled:
            return None
        model, flow, objective = demand.model, demand.flow, demand.objective
        name = control.config.objective(objective)[0]
        waiter: Waiter = asyncio.get_running_loop().create_future()
        try:
            entry = control.admit(waiter, demand, partial(self.room, model))
        except Refused as refused:
            raise self._refused(refused.code, refused.retry_after_s, name) from None
        ticket = FlowTicket(flow, name, model, entry=entry)
        if entry is None:
            self._metrics.flow_dispatched(name, "at_once").inc()
            await self._slotted(ticket, self.clock() + control.config.objective(objective)[1].max_queue_s)
            return ticket
        self._metrics.flow_queued(name).inc()
        self._count(name, flow)
        self.pump()  # those waiting may all be held by their limits while this one may go
        queued_at = self.clock()
        try:
            async with asyncio.timeout(entry.deadline - queued_at):
                await asyncio.shield(waiter)
        except TimeoutError:
            if not waiter.done():  # else it was let go as its time ran out: it goes
                control.leave(entry)
                retry_after_s = max(1, round(control.config.objective(objective)[1].max_queue_s))
                raise self._refused("queue_timeout", retry_after_s, name) from None
        except asyncio.CancelledError:  # the client left while it waited (or just as it was let go)
            if waiter.done():
                ticket.granted = True
                self.leave(ticket)
            else:
                control.leave(entry)
            raise
        finally:
            ticket.queued_s = self.clock() - queued_at
            self._metrics.flow_queue_seconds(name).observe(ticket.queued_s)
            self._count(name, flow)
        self._metrics.flow_dispatched(name, "queued").inc()
        ticket.granted = True
        await self._slotted(ticket, entry.deadline)
        return ticket

    async def _slotted(self, ticket: FlowTicket, deadline: float) -> None:
        """With replicas sharing a store, the request's slots of its limits in flight, taken there: while
        other replicas hold the last of one it waits (its room here given up), until deadline (a 429)."""
        slots = self.slots
        limits = self.control.limits_in_flight(ticket.flow, ticket.objective) if slots is not None else []
        if slots is None or not limits:
            return
        try:
            waited = False
            while not await slots.take(limits):
                if not waited:
                    waited = True
                    self._metrics.flow_slot_waits(ticket.objective).inc()
                    if ticket.granted and ticket.entry is not None:  # others may use the room meanwhile
                        ticket.granted = False
                        self.control.placed(ticket.entry)
                left = deadline - self.clock()
                if left <= 0:
                    retry_after_s = max(1, round(self.config.objective(ticket.objective)[1].max_queue_s))
                    raise self._refused("queue_timeout", retry_after_s, ticket.objective)
                may_take, self._slot_waiting = self._may_take, self._slot_waiting + 1
                try:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(min(SLOT_RETRY_S, left)):
                            await may_take.wait()
                finally:
                    self._slot_waiting -= 1
            ticket.slots = tuple(key for key, _ in limits)
        except BaseException:  # refused, or its client left: it is over
            self.leave(ticket)
            raise

    def started(self, ticket: FlowTicket | None) -> None:
        """The request let go is about to be counted at its instance, with no await before: the room it
        takes is accounted by the time the next waiter may be let go."""
        if ticket is not None and ticket.granted and ticket.entry is not None:
            ticket.granted = False
            asyncio.get_running_loop().call_soon(self._placed, ticket.entry)

    def leave(self, ticket: FlowTicket | None) -> None:
        """A request admitted by flow control is over (once only, whichever end comes first)."""
        if ticket is None or ticket.ended:
            return
        ticket.ended = True
        if ticket.granted and ticket.entry is not None:  # it never started
            ticket.granted = False
            self.control.placed(ticket.entry)
        self.control.ended(ticket.flow, ticket.objective)
        if ticket.slots and self.slots is not None:
            self.slots.give_back(ticket.slots)
        self.pump()

    def _placed(self, entry: Queued[Waiter]) -> None:
        self.control.placed(entry)
        self.pump()

    async def tick(self) -> None:
        """Room can also appear without an event here (an instance back to health, a silent peer's counts
        dropped): looked for every tick while requests wait."""
        if self.control.queued():
            self.pump()

    def pump(self) -> None:
        """Room may have appeared: let go the waiters that may go now (and those waiting for another
        replica's slot ask the store again)."""
        if self._slot_waiting:
            self._may_take.set()
            self._may_take = asyncio.Event()
        control = self.control
        while (entry := control.next_ready()) is not None:
            entry.item.set_result(None)

    def _count(self, objective: str, flow: str) -> None:
        """The queue-length gauges of objective and flow, after one of theirs came or went."""
        control, metrics = self.control, self._metrics
        metrics.flow_queue_length(objective).set(control.queued_by_objective(objective))
        by_flow, labelled = metrics.flow_queue_length_by_flow, self._labelled
        queued = control.queued_by_flow(flow)
        label = labelled.get(flow)
        if label is None and queued and len(labelled) < FLOW_SERIES:
            label = labelled[flow] = flow_label(flow)
        if label is not None:
            by_flow(label).set(queued)
            if not queued:  # a series per flow ever seen would be without bound
                del labelled[flow]
                by_flow.drop(label)
        others = control.queued() - sum(control.queued_by_flow(f) for f in labelled)
        by_flow(OTHER_FLOWS).set(others)

    def _refused(self, code: str, retry_after_s: int, objective: str) -> OpenAIError:
        self._metrics.rejected(code).inc()
        self._metrics.flow_refused(objective, code).inc()
        message = {
            "queue_full": f"Too many requests of objective `{objective}` are waiting; retry later.",
            "flow_queue_full": "Too many of this client's requests are waiting; retry later.",
            "queue_timeout": f"No instance had room within `{objective}`'s queue time; retry later.",
            "rate_limited": "This client or objective is over its tokens per second; retry later.",
        }[code]
        error = too_many_requests(message, code, retry_after_s)
        error.headers["x-kvroute-dropped-reason"] = code
        return error
