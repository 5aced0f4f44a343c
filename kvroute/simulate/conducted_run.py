"""A trace through the fleet behind kvroute's own router, its requests taken by the product's conductor
(kvroute/simulate/conducted.py) as `kvroute serve` takes them: the run keeps the clients' side (sessions'
turns, tool calls, what each request waited and found) and the engines; every routing step is the router's.
On a prefill/decode fleet both legs go through it; several replicas each have their own conductor, the load
balancer in front choosing one for each request, and those that share tell each other through the
product's snapshots (router/upstreams/peer_sync.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from kvroute.simulate.blocks import TraceBlocks
from kvroute.simulate.conducted import EngineSender, SimulatedRouter
from kvroute.simulate.engine import SimRequest
from kvroute.simulate.hardware import FleetSpec
from kvroute.simulate.policies import PEERS_STALE_AFTER_S, ConfiguredPolicy, Replicas, SimPolicy
from kvroute.simulate.results import RunResult
from kvroute.simulate.run import Run, session_of
from router.dispatch.wait.flow_control import FlowControl
from router.dispatch.wait.flow_gate import Waiter
from router.dispatch.wait.flow_queue import Queued
from router.errors import OpenAIError
from router.upstreams.peer_sync import PeerEndpoints
from scorers.ttft_model import TTFTPriors


class ConductedRun(Run):
    def __init__(
        self,
        blocks: TraceBlocks,
        fleet: FleetSpec,
        policy: SimPolicy,
        priors: TTFTPriors | None = None,
        progress: Callable[[int], None] | None = None,
        tie_seed: int = 0,
    ) -> None:
        if not policy.conducts:
            raise ValueError(f"{policy.name} is no kvroute router")
        super().__init__(blocks, fleet, policy, priors, progress, tie_seed)
        self.sender = EngineSender(self.loop, self.engines, self.view)
        peers = None
        if policy.sync_interval_s is not None:
            peers = PeerEndpoints(interval_s=policy.sync_interval_s, stale_after_s=PEERS_STALE_AFTER_S)
        # Each replica on its own view (its own index fed the same events, its own counts and models).
        self.routers = [
            SimulatedRouter(member.config, member.policy_name, member.view, self.sender, peers)
            for member in _routers_of(policy)
        ]
        for engine in self.engines:
            engine.on_first_token, engine.on_finish = self._first_token, self._finished
        self._answers: dict[int, asyncio.Future[None]] = {}  # by request number: its last token
        self._serving: set[asyncio.Task[None]] = set()  # held: asyncio keeps only weak references
        self._sharing: list[asyncio.Task[None]] = []  # the replicas' snapshot loops, while requests go on
        self._retried = 0  # refusals another attempt followed, as Run.retried counts them
        for router in self.routers:
            self._count_backlogged_dispatches(router.flow_gate.control)

    def _count_backlogged_dispatches(self, control: FlowControl[Waiter]) -> None:
        """What the run's own queue counts as it lets requests go (Run._let_go), counted as the router's
        flow control lets them go: by the trace's flow, those let go while another flow waited."""
        let_go = control.next_ready
        flows = {request.flow for request in self.trace if request.flow is not None}
        backlogged = self.backlogged_dispatches

        def counted() -> Queued[Waiter] | None:
            entry = let_go()
            if entry is not None and entry.flow in flows:
                waiting = control.queues()[entry.model].by_flow
                if len(waiting) > (entry.flow in waiting):
                    backlogged[entry.flow] = backlogged.get(entry.flow, 0) + 1
            return entry

        control.next_ready = counted  # type: ignore[method-assign]

    def _schedule(self) -> None:
        """The first arrival and the engines' scrapes, as for any router; replicas that share their state
        run their own snapshot loops (router/upstreams/peer_sync.py) from then on, in place of the policy's
        sync."""
        self.loop.at(self.trace[0].arrival_s, lambda: self._arrive(0))
        if self.policy.scrape_interval_s is not None:
            self._every(self.policy.scrape_interval_s, self._scrape)
        if self.policy.sync_interval_s is not None:
            self.loop.at(self.trace[0].arrival_s, self._start_sharing)

    def _start_sharing(self) -> None:
        """Each replica's snapshots reach the others a store's round trip after it sends them."""
        latency = self.policy.share_latency_s
        for router in self.routers:
            others = [other for other in self.routers if other is not router]

            async def send(snapshot: bytes, others: list[SimulatedRouter] = others) -> None:
                self.loop.at(self.loop.now + latency, lambda: _deliver(snapshot, others))

            for loop in router.share(send).values():
                task = self.aio.create_task(_running(loop))
                task.add_done_callback(_failed_at_once)
                self._sharing.append(task)

    def run(self, ideal_hit_rate: float) -> RunResult:
        try:
            result = super().run(ideal_hit_rate)
        finally:
            for router in self.routers:
                router.close()
        result.retried = self._retried
        if self.sender.warm_ups:
            result.programs["warm_ups"] = float(self.sender.warm_ups)
        return result

    def _submit(self, number: int) -> None:
        traced = self.trace[number]
        request = SimRequest(number, traced, self.blocks.chains[number], session_of(traced), self.loop.now)
        if not self.engines[0].fits(traced):  # vLLM's 400: longer than the model's context
            self.rejected += 1
            self._release(request)
            return
        self.outstanding += 1
        request.router = self.policy.router_of(request)
        task = self.aio.create_task(self._serve(request))
        self._serving.add(task)
        task.add_done_callback(self._served)

    def _served(self, task: asyncio.Task[None]) -> None:
        self._serving.discard(task)
        task.result()  # what failed in the router's code fails the run, at once

    def _release(self, request: SimRequest) -> None:
        super()._release(request)
        if self._sharing and not self._going_on():  # the last request ended: the replicas stop telling
            for task in self._sharing:
                task.cancel()
            self._sharing.clear()

    async def _serve(self, request: SimRequest) -> None:
        """As a client: sends request, reads its answer to the end."""
        router = self.routers[request.router]
        prompt = self.blocks.prompt_ids(request.number)
        # Its last token may come in the step of its first, before this coroutine is back from the conductor.
        answer = self._answers[request.number] = asyncio.get_running_loop().create_future()
        try:
            outcome = await router.serve(request, prompt, str(request.number))
        except OpenAIError as error:
            del self._answers[request.number]
            self.sender.release(request)
            self._retried += max(len(request.tried) - 1, 0)  # the last refusal, if any, ended it
            if error.status == 429:
                code = str(error.code)
                self.refused_by_router[code] = self.refused_by_router.get(code, 0) + 1
            self.refused(request, failed=error.status >= 500 and error.status != 503)
            return
        if outcome.status != 200:  # every instance it could try was busy
            del self._answers[request.number]
            self.sender.release(request)
            self._retried += len(request.tried) - 1
            router.ended(outcome)
            self.refused(request)
            return
        self._retried += len(request.tried)
        request.queued_s = 0.0 if outcome.ticket is None else outcome.ticket.queued_s
        request.path = outcome.pd_path  # how the router served it, on a disaggregated fleet
        await answer
        router.ended(outcome)
        self.done.append(request)
        self.outstanding -= 1
        self._release(request)

    # The router hears an engine's first token or last one and acts on it (lets queued requests go, sends a
    # session's next turn) before the engine goes on, as the run's own steps do for every peer: a router's
    # and a client's reactions take no simulated time, whoever's they are.
    def _first_token(self, request: SimRequest) -> None:
        self.answered_s = self.loop.now
        self.sender.first_token(request)
        self.loop.drain()

    def _finished(self, request: SimRequest) -> None:
        self.answered_s = self.loop.now
        self.sender.finished(request)
        if not request.warm_up and request.prefills is None:
            self._answers.pop(request.number).set_result(None)
        self.loop.drain()


def _routers_of(policy: SimPolicy) -> list[ConfiguredPolicy]:
    """The kvroute routers policy is: itself, or the replicas it runs (bound already)."""
    members = policy.members if isinstance(policy, Replicas) else [policy]
    routers = [member for member in members if isinstance(member, ConfiguredPolicy) and member.conducts]
    if len(routers) != len(members):
        raise ValueError(f"{policy.name} is no kvroute router")
    return routers


def _deliver(snapshot: bytes, routers: list[SimulatedRouter]) -> None:
    for router in routers:
        assert router.peers is not None
        router.peers.receive(snapshot)


async def _running(loop: Callable[[], Awaitable[None]]) -> None:
    await loop()


def _failed_at_once(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.result()  # a replica's snapshot loop that failed fails the run
