"""One simulation: a trace through a fleet of engines, aggregated or prefill/decode, behind one policy."""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from functools import partial

from kvroute.simulate.blocks import TraceBlocks
from kvroute.simulate.clock import EventLoop
from kvroute.simulate.disaggregation import PDPolicy
from kvroute.simulate.engine import Engine, SimRequest, warm_up_of
from kvroute.simulate.hardware import FleetSpec
from kvroute.simulate.policies import SimPolicy
from kvroute.simulate.pool import PoolStore
from kvroute.simulate.results import RunResult, result_of
from kvroute.simulate.trace_loop import TraceLoop
from kvroute.simulate.view import RouterView
from kvroute.traces import TraceRequest
from router.dispatch.wait.flow_control import DEFAULT_FLOW, Demand, FlowControl, Refused
from router.dispatch.wait.memory_gate import MemoryGate
from router.upstreams.settings import UpstreamConfig
from scorers.ttft_model import TTFTPriors


def session_of(request: TraceRequest) -> str | None:
    """The session its client names (a header, `previous_response_id`): the trace's. A trace that names none
    (Mooncake's) gives none, to every router: its hash ids are not something a client sends."""
    return request.session


def last_turns(trace: Sequence[TraceRequest]) -> frozenset[int]:
    """The numbers of the requests that are their sessions' last turns."""
    last: dict[str, int] = {}
    for number, request in enumerate(trace):
        if request.session is not None:
            last[request.session] = number
    return frozenset(last.values())


# Requests outstanding while no engine gave a first or a last token for this long of simulated time: the
# simulation waits for something nothing will do (a future never resolved, a request held for good), and
# fails rather than run its periodic timers forever or report what never finished.
STALLED_AFTER_S = 600.0


class SimulationStalled(RuntimeError):
    pass


# A refused request is retried, for every policy, as kvroute's proxy retries a 503 before the first byte: on
# an instance not tried yet, within its default attempts, at once (router/dispatch/place/verdict.py).
ATTEMPTS = UpstreamConfig().attempts


class Run:
    """A trace through the fleet: requests arrive (a session's turn once the previous one is answered), the
    policy routes them, the engines serve them."""

    def __init__(
        self,
        blocks: TraceBlocks,
        fleet: FleetSpec,
        policy: SimPolicy,
        priors: TTFTPriors | None = None,
        progress: Callable[[int], None] | None = None,
        tie_seed: int = 0,
    ) -> None:
        self.blocks, self.fleet, self.policy, self._progress = blocks, fleet, policy, progress
        self.loop = loop = EventLoop()
        # The router's coroutines, on the same clock (kvroute/simulate/conducted.py). (Abstract only in what
        # a loop does with sockets, threads and processes, which a simulated router never asks for.)
        self.aio = TraceLoop(loop)  # type: ignore[abstract]
        self.pool = pool = PoolStore(fleet.pool_blocks()) if fleet.pool is not None else None
        load_s = fleet.pool.load_s_per_token if fleet.pool is not None else 0.0
        transfer_s = fleet.pd.transfer_s_per_token if fleet.pd is not None else 0.0
        self.engines = [
            Engine(n, fleet.engine, blocks, loop, pool, load_s, transfer_s) for n in range(fleet.instances)
        ]
        priors = priors or policy.priors or TTFTPriors()
        self.view = RouterView(fleet, loop, self.engines, pool, priors, tie_seed=tie_seed)
        self.trace = blocks.trace.requests
        policy.last_turns = last_turns(self.trace)
        policy.bind(self.view)
        self.done: list[SimRequest] = []
        self.rejected = 0
        self.failed = 0
        self.retried = 0  # refused by an instance, then sent to another
        self.warm_ups = 0  # the router's prefills of programs' next turns (programs.warm_up)
        self.outstanding = 0  # sent and not finished, held in the router included
        self.answered_s = 0.0  # the last first or last token any engine gave (what a stall is judged by)
        self.hold: MemoryGate[SimRequest] = MemoryGate(policy.memory_hold_s, loop.clock)
        # Each router's queue (replicas each have their own, sharing their flows' counts: _share_flows).
        self.flows: list[FlowControl[SimRequest]] = []
        if policy.flow_control is not None:
            self.flows = [FlowControl(policy.flow_control, loop.clock) for _ in range(policy.routers)]
        self.refused_by_router: dict[str, int] = {}  # flow control's refusals, by reason
        self.backlogged_dispatches: dict[str, int] = {}  # by trace flow, let go while 2+ flows waited
        # An agent sends its next turn only once it has the answer to the previous one: a session's turn waits
        # for that, however early the trace has it (traces without sessions are open loop).
        self._busy_sessions: set[str] = set()
        self._held_back: dict[str, deque[int]] = {}
        # And a turn that runs a tool first (TraceRequest.tool_s) comes no sooner than that after the answer.
        self._answered_s: dict[str, float] = {}  # sessions answered whose next turn has not arrived yet
        self._in_tool_calls = 0  # turns whose tool call runs
        for engine in self.engines:
            engine.on_first_token, engine.on_finish = self.first_token, self.finish
            engine.on_fetched = self._fetched

    def run(self, ideal_hit_rate: float) -> RunResult:
        started = time.perf_counter()
        policy = self.policy
        if self.trace:
            self._schedule()
        self.aio.run()
        if self.outstanding:  # nothing left to happen, and these were never answered
            raise SimulationStalled(f"{self.outstanding} requests were never answered")
        result = result_of(
            policy.name,
            self.done,
            self.rejected,
            self.engines,
            ideal_hit_rate,
            self.fleet,
            time.perf_counter() - started,
            self.failed,
            self.retried,
            self.backlogged_dispatches,
            Counter(r.session for r in self.trace if r.session is not None),
        )
        if self.warm_ups:
            result.programs["warm_ups"] = float(self.warm_ups)
        return result

    def _fetched(self, request: SimRequest) -> None:
        """A decode leg has its prompt's KV (a disaggregated fleet): the prefill instance frees it."""
        assert request.prefill is not None
        self.engines[request.prefill.instance].release(request.prefill)

    def _schedule(self) -> None:
        """The trace's first arrival, and what the routers do every so often from then on."""
        policy = self.policy
        self.loop.at(self.trace[0].arrival_s, lambda: self._arrive(0))
        if policy.scrape_interval_s is not None:
            self._every(policy.scrape_interval_s, self._scrape)
        if policy.sync_interval_s is not None:
            self._every(policy.sync_interval_s, policy.sync)
            if len(self.flows) > 1:
                self._every(policy.sync_interval_s, self._share_flows)

    def _going_on(self) -> bool:
        """Requests are to come, in flight, or held for their sessions' previous turns or tool calls."""
        trace = self.trace
        busy = self.outstanding or self._held_back or self._in_tool_calls
        return bool(busy) or self.loop.now < trace[-1].arrival_s

    # The router's own counts of what it sent to each instance (router/upstreams/instances.py).
    def started(self, request: SimRequest) -> None:
        request.pending = request.uncached_estimate
        instance = self.policy.instances_for(request)[request.instance]
        instance.start(request.trace.input_tokens, request.uncached_estimate, request.chain)

    def retire(self, request: SimRequest) -> None:
        """Its uncached tokens are no longer queued at its instance, for its router."""
        self.policy.instances_for(request)[request.instance].own_pending_prefill_tokens -= request.pending
        request.pending = 0

    def ended(self, request: SimRequest, admitted: bool = True) -> None:
        instance = self.policy.instances_for(request)[request.instance]
        instance.end(request.trace.input_tokens, request.pending, admitted=admitted, chain=request.chain)
        request.pending = 0

    def first_token(self, request: SimRequest) -> None:
        self.answered_s = self.loop.now
        self.retire(request)
        if request.warm_up:
            return
        self.policy.first_token(request)
        self._let_go()

    def finish(self, request: SimRequest) -> None:
        self.answered_s = self.loop.now
        self.ended(request)
        if request.warm_up:  # no client's: room freed, and nothing else
            self.policy.finished(request)
            self._release_held()
            self._let_go()
            return
        self.policy.finished(request)
        warm_at = self.policy.warm_up(request)
        if warm_at is not None:
            self._warm(request, *warm_at)
        self.done.append(request)
        self.outstanding -= 1
        self._flow_ended(request)
        self._release(request)
        self._release_held()
        self._let_go()

    def _warm(self, request: SimRequest, instance: int, uncached_tokens: int) -> None:
        """request's prompt prefilled at instance, one token, as the router sends a warm-up; uncached_tokens:
        those it counts as queued there."""
        warm = warm_up_of(request, instance, self.loop.now)
        warm.uncached_estimate = uncached_tokens
        self.warm_ups += 1
        self.started(warm)
        if not self.engines[instance].enqueue(warm):
            self.ended(warm, admitted=False)

    def refused(self, request: SimRequest, failed: bool = False) -> None:
        """The request never reached an engine that would serve it: the client had a 503 (or a 500)."""
        if failed:
            self.failed += 1
        else:
            self.rejected += 1
        self.outstanding -= 1
        self._flow_ended(request)
        self._release(request)
        self._release_held()
        self._let_go()

    def _flow_ended(self, request: SimRequest) -> None:
        if self.flows and request.flow is not None:
            self.flows[request.router].ended(request.flow, request.objective)

    def _share_flows(self) -> None:
        """Replicas tell each other their flows' counts, as their snapshots carry them
        (router/upstreams/peer_sync.py), each heard after the store's latency."""
        told = [flow.shared() for flow in self.flows]
        latency = self.policy.share_latency_s

        def deliver() -> None:
            for number, flow in enumerate(self.flows):
                for peer, counts in enumerate(told):
                    if peer != number:
                        flow.heard(str(peer), counts)
            self._let_go()

        self.loop.at(self.loop.now + latency, deliver)

    def _room(self, router: int, extra_work: float, extra_tokens: int) -> bool:
        """Whether an instance may take a request now (router/dispatch/wait/saturation.py), by router's
        counts; of a disaggregated fleet, a prefill instance and a decode instance. extra_work and
        extra_tokens: those let go and not yet placed, which the simulator places at once; they are not 0 only
        while an engine's refusal inside dispatch() admits or lets go others."""
        own_rule = self.policy.has_room(extra_work)
        if own_rule is not None:
            return own_rule
        instances, saturation = self.policy.counts_of(router), self.flows[router].saturation
        if self.fleet.pd is None:
            return saturation.has_room(instances, extra_work, extra_tokens)
        prefill = [i for i in instances if i.role == "prefill"]
        decode = [i for i in instances if i.role != "prefill"]
        return saturation.stages_have_room(prefill, decode, extra_work, extra_tokens)

    def _let_go(self) -> None:
        """Room may have appeared: the requests waiting in the routers' queues that may go now, placed."""
        for flow in self.flows:
            while (entry := flow.next_ready()) is not None:
                request = entry.item
                request.queued_s = self.loop.now - entry.since
                traced = request.trace.flow
                waiting = flow.queues()[entry.model].by_flow
                if traced is not None and len(waiting) > (entry.flow in waiting):  # another flow waits too
                    self.backlogged_dispatches[traced] = self.backlogged_dispatches.get(traced, 0) + 1
                self._admit(request)
                flow.placed(entry)

    def _expire(self) -> None:
        for flow in self.flows:
            for entry in flow.expired():
                self._refuse_in_router(entry.item, "queue_timeout")

    def _refuse_in_router(self, request: SimRequest, reason: str) -> None:
        """Flow control refused request with a 429: it never reached an engine."""
        self.refused_by_router[reason] = self.refused_by_router.get(reason, 0) + 1
        self.rejected += 1
        self.outstanding -= 1
        self._release(request)

    def _release_held(self) -> None:
        """Memory freed up: the requests held in the router that now fit go
        (router/dispatch/wait/memory_gate.py)."""
        if len(self.hold):
            for held in self.hold.release():
                self.hold.started(held.trace.input_tokens)
                self.dispatch(held)

    def _release(self, request: SimRequest) -> None:
        session = request.trace.session
        if session is None:
            return
        waiting = self._held_back.get(session)
        if waiting:
            number = waiting.popleft()
            if not waiting:
                del self._held_back[session]
            tool_s = self.trace[number].tool_s
            if tool_s is None:
                self._submit(number)
            else:
                self._after_tool_call(number, self.loop.now + tool_s)
        else:
            self._busy_sessions.discard(session)
            self._answered_s[session] = self.loop.now

    def _arrive(self, number: int) -> None:
        trace = self.trace
        if number + 1 < len(trace):
            self.loop.at(trace[number + 1].arrival_s, lambda: self._arrive(number + 1))
        if self._progress is not None and number % 500 == 0:
            self._progress(number)
        session = trace[number].session
        if session is not None:
            if session in self._busy_sessions:
                self._held_back.setdefault(session, deque()).append(number)
                return
            self._busy_sessions.add(session)
            answered_s, tool_s = self._answered_s.pop(session, None), trace[number].tool_s
            if answered_s is not None and tool_s is not None and answered_s + tool_s > self.loop.now:
                self._after_tool_call(number, answered_s + tool_s)
                return
        self._submit(number)

    def _after_tool_call(self, number: int, done_s: float) -> None:
        """Turn number is sent once its tool call is done, at done_s."""
        self._in_tool_calls += 1

        def send() -> None:
            self._in_tool_calls -= 1
            self._submit(number)

        self.loop.at(done_s, send)

    def _submit(self, number: int) -> None:
        traced = self.trace[number]
        request = SimRequest(number, traced, self.blocks.chains[number], session_of(traced), self.loop.now)
        request.text_chain = self.blocks.text_chain(number)
        if not self.engines[0].fits(traced) or self.policy.sheds(request):
            self.rejected += 1
            self._release(request)
            return
        self.outstanding += 1
        request.router = self.policy.router_of(request)
        if self.flows and not self._queue(request):
            return
        self._admit(request)

    def _admit(self, request: SimRequest) -> None:
        """Past the router's queue, as the proxy's waiting stage goes on (router/dispatch/wait/waiting.py):
        the policy's own admission (kvroute's by program), then the hold for memory, then the decision."""
        if self.policy.admit(request, self._hold_or_dispatch):
            self._hold_or_dispatch(request)

    def _hold_or_dispatch(self, request: SimRequest) -> None:
        view, tokens = self.view, request.trace.input_tokens
        if self.hold.must_wait(tokens, view.instances, request.chain):
            self.hold.hold(request, tokens, lambda: view.instances, request.chain)
            return
        self.dispatch(request)

    def _queue(self, request: SimRequest) -> bool:
        """Whether request goes now; else it waits in its router's queue, or was refused."""
        flow = self.flows[request.router]
        traced = request.trace
        flows = self.policy.queue_flows
        named = None if flows == "one" else traced.flow or (request.session if flows != "tenant" else None)
        request.flow = named or DEFAULT_FLOW
        request.objective = flow.config.objective(traced.objective)[0]
        work = self.policy.work(request)
        try:
            entry = flow.admit(
                request,
                Demand(self.view.model, request.flow, traced.objective, work, traced.input_tokens),
                partial(self._room, request.router),
            )
        except Refused as refused:
            request.flow = None
            self._refuse_in_router(request, refused.code)
            return False
        if entry is None:
            return True
        self.loop.at(entry.deadline, self._expire)
        self._let_go()  # those waiting may all be held by their limits while this one may go
        return False

    def dispatch(self, request: SimRequest) -> None:
        request.uncached_estimate = request.trace.input_tokens
        request.dispatched_s = self.loop.now
        request.instance = self.policy.route(request)
        request.priority = self.policy.engine_priority(request)
        self.started(request)
        if not self.engines[request.instance].enqueue(request):
            self.ended(request, admitted=False)
            self.policy.refused(request)
            request.tried |= {request.instance}
            if len(request.tried) < min(ATTEMPTS, len(self.engines)):
                # As the proxy retries a 503 that came before the first byte: on another instance, at once
                # (router/dispatch/place/verdict.py); the client sees one request.
                self.retried += 1
                self.dispatch(request)
            else:
                self.refused(request)

    def _scrape(self) -> None:
        self.view.scrape()
        if self.policy.queue_reads_metrics:  # its queue lets requests go as the metrics it reads change
            self._let_go()

    def _every(self, interval: float, action: Callable[[], None]) -> None:
        """Do action from the first arrival on, every interval, while requests are to come or in flight."""
        loop = self.loop

        def tick() -> None:
            action()
            if self.outstanding and loop.now - self.answered_s > STALLED_AFTER_S:
                silent = f"no engine answered for {STALLED_AFTER_S:.0f} s"
                raise SimulationStalled(f"{self.outstanding} requests outstanding and {silent}")
            if self._going_on():
                loop.at(loop.now + interval, tick)

        loop.at(self.trace[0].arrival_s, tick)


class DisaggregatedRun(Run):
    """A prefill/decode fleet: a request's prefill leg, then its decode leg, or its decode instance alone
    (kvroute/simulate/disaggregation.py). The router counts each leg at its instance while it runs there; a
    decode leg chosen before the prefill leg also meanwhile."""

    def __init__(
        self,
        blocks: TraceBlocks,
        fleet: FleetSpec,
        policy: SimPolicy,
        priors: TTFTPriors | None = None,
        progress: Callable[[int], None] | None = None,
        tie_seed: int = 0,
    ) -> None:
        if not isinstance(policy, PDPolicy):
            raise ValueError(f"{policy.name} does not route a disaggregated fleet")
        super().__init__(blocks, fleet, policy, priors, progress, tie_seed)
        self.pd = policy

    def dispatch(self, request: SimRequest) -> None:
        request.uncached_estimate = request.trace.input_tokens
        request.dispatched_s = self.loop.now
        decode = self.pd.plan(request)
        if decode is not None:
            request.instance = decode
            self.started(request)
        if request.prefill is None:
            request.path = request.path or "skipped"
            self._send_decode(request)
        else:
            self._send_prefill(request)

    def _send_prefill(self, request: SimRequest) -> None:
        leg = request.prefill
        assert leg is not None
        leg.sent_s = leg.dispatched_s = self.loop.now
        self.started(leg)
        if leg.retire_after_s is not None:
            self.loop.at(self.loop.now + leg.retire_after_s, lambda: self.retire(leg))
        if self.engines[leg.instance].enqueue(leg):
            return
        self.ended(leg, admitted=False)
        self.policy.refused(leg)
        refusal = self.pd.prefill_refused(request)
        if refusal == "retry":
            self._send_prefill(request)
        elif refusal == "local":
            request.prefill, request.path = None, "fallback"
            if request.instance < 0:
                request.instance = self.pd.decode_for(request)
            else:  # counted as a decode leg: now as the whole request
                self.ended(request, admitted=False)
            self.started(request)
            self._send_decode(request)
        else:
            if request.instance >= 0:
                self.ended(request, admitted=False)
                self.policy.refused(request)
            self.refused(request, failed=refusal == "fail")

    def finish(self, request: SimRequest) -> None:
        whole = request.prefills
        if whole is None:
            super().finish(request)
            return
        self.answered_s = self.loop.now
        self.ended(request)  # the prefill leg answered: its KV waits for the decode leg
        self.policy.finished(request)
        if whole.instance < 0:
            whole.instance = self.pd.decode_for(whole)
            self.started(whole)
        whole.path = "disaggregated"
        self._send_decode(whole)

    def _send_decode(self, request: SimRequest) -> None:
        if self.engines[request.instance].enqueue(request):
            return
        if request.prefill is not None:
            self.engines[request.prefill.instance].release(request.prefill)
        self.ended(request, admitted=False)
        self.policy.refused(request)
        self.refused(request)
